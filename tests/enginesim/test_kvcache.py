from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from enginesim.kvcache import CacheNamespace, Cleared, PagedKVCache, Removed, Stored, page_hash


def tokens(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def test_first_request_stores_whole_pages_chained_from_root() -> None:
    cache = PagedKVCache(page_size=4, capacity=16)
    prompt = tokens(0, 10)
    assert cache.match(prompt).cached_tokens == 0
    changes = cache.insert(prompt)
    h0 = page_hash(None, prompt[0:4])
    h1 = page_hash(h0, prompt[4:8])
    assert changes == [Stored(parent=None, hashes=(h0, h1), token_ids=tuple(prompt[:8]))]
    assert len(cache) == 2


def test_second_request_reuses_prefix_and_stores_only_the_new_pages() -> None:
    cache = PagedKVCache(page_size=4, capacity=16)
    cache.insert(tokens(0, 8))
    follow_up = [*tokens(0, 8), *tokens(100, 9)]
    match = cache.match(follow_up)
    assert match.cached_tokens == 8
    changes = cache.insert(follow_up)
    cache.release(match)
    [stored] = changes
    assert isinstance(stored, Stored)
    assert stored.parent == page_hash(page_hash(None, tokens(0, 4)), tokens(4, 4))
    assert stored.token_ids == tuple(tokens(100, 8))
    assert len(stored.hashes) == 2


def test_last_prompt_token_is_never_served_from_cache() -> None:
    cache = PagedKVCache(page_size=4, capacity=16)
    cache.insert(tokens(0, 8))
    match = cache.match(tokens(0, 8))
    assert match.cached_tokens == 4


def test_lru_evicts_least_recently_used_leaf_first() -> None:
    cache = PagedKVCache(page_size=2, capacity=4)
    cache.insert([1, 2, 3, 4])
    cache.insert([5, 6, 7, 8])
    cache.release(cache.match([1, 2, 3, 4, 0]))
    changes = cache.insert([9, 10])
    evicted_leaf = page_hash(page_hash(None, [5, 6]), [7, 8])
    assert changes[0] == Removed((evicted_leaf,))
    assert isinstance(changes[1], Stored)
    assert cache.match([5, 6, 0]).cached_tokens == 2
    assert cache.match([1, 2, 3, 4, 0]).cached_tokens == 4


def test_inner_pages_go_only_after_their_children() -> None:
    cache = PagedKVCache(page_size=1, capacity=3)
    cache.insert([1, 2, 3])
    changes = cache.insert([7, 8])
    h1 = page_hash(None, [1])
    h2 = page_hash(h1, [2])
    h3 = page_hash(h2, [3])
    assert changes[0] == Removed((h3, h2))


def test_locked_prefix_is_not_evicted_and_overflow_is_left_uncached() -> None:
    cache = PagedKVCache(page_size=2, capacity=2)
    cache.insert([1, 2, 3, 4])
    running = cache.match([1, 2, 3, 4, 5])
    assert running.cached_tokens == 4
    changes = cache.insert([9, 9, 8, 8])
    assert changes == []
    assert cache.stats().uncached_pages == 2
    cache.release(running)
    changes = cache.insert([9, 9, 8, 8])
    assert isinstance(changes[0], Removed)
    assert len(changes[0].hashes) == 2


def test_reset_clears_and_released_old_pages_never_evict_new_ones() -> None:
    cache = PagedKVCache(page_size=2, capacity=2)
    cache.insert([1, 2, 3, 4])
    held = cache.match([1, 2, 3, 4, 5])
    assert cache.reset() == [Cleared()]
    assert len(cache) == 0
    cache.release(held)
    cache.insert([5, 6, 7, 8])
    changes = cache.insert([9, 10])
    assert changes[0] == Removed((page_hash(page_hash(None, [5, 6]), [7, 8]),))


def test_peek_finds_what_match_would_without_locking_or_refreshing_it() -> None:
    cache = PagedKVCache(page_size=2, capacity=4)
    cache.insert([1, 2, 3, 4])
    cache.insert([5, 6, 7, 8])
    assert cache.peek([1, 2, 3, 4, 0]) == 4
    assert cache.peek([1, 2, 3, 4]) == 2, "the last prompt token is never served from cache"
    assert cache.stats().locked_pages == 0
    changes = cache.insert([9, 10])
    evicted_oldest = page_hash(page_hash(None, [1, 2]), [3, 4])
    assert changes[0] == Removed((evicted_oldest,)), "a peek does not count as a use"


def test_release_is_idempotent() -> None:
    cache = PagedKVCache(page_size=2, capacity=4)
    cache.insert([1, 2, 3])
    match = cache.match([1, 2, 3])
    cache.release(match)
    cache.release(match)
    assert cache.stats().locked_pages == 0


@pytest.mark.parametrize(("page_size", "capacity"), [(0, 1), (1, 0)])
def test_rejects_non_positive_sizes(page_size: int, capacity: int) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        PagedKVCache(page_size=page_size, capacity=capacity)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=12), max_size=30))
def test_events_replayed_describe_exactly_the_cached_pages(prompts: list[list[int]]) -> None:
    """An indexer applying the change stream must end with what the cache holds."""
    cache = PagedKVCache(page_size=2, capacity=5)
    held: set[int] = set()
    for prompt in prompts:
        match = cache.match(prompt)
        for change in cache.insert(prompt):
            if isinstance(change, Stored):
                assert change.parent is None or change.parent in held
                assert not held.intersection(change.hashes)
                held.update(change.hashes)
            elif isinstance(change, Removed):
                assert held.issuperset(change.hashes)
                held.difference_update(change.hashes)
        cache.release(match)
        assert len(held) == len(cache) <= 5


def test_cached_chains_are_each_leaf_prefix_from_the_root_and_follow_eviction() -> None:
    cache = PagedKVCache(page_size=2, capacity=4)
    cache.insert([1, 2, 3, 4, 5])  # pages [1,2] [3,4]; the partial 5 is not kept
    cache.insert([1, 2, 7, 8, 9])  # shares [1,2]
    assert cache.cached_chains() == [[1, 2, 3, 4], [1, 2, 7, 8]]
    cache.insert([20, 21, 22, 23, 24])  # two more pages: the oldest leaf goes
    assert cache.cached_chains() == [[1, 2, 7, 8], [20, 21, 22, 23]]
    cache.reset()
    assert cache.cached_chains() == []


def test_namespaces_share_nothing_and_their_hashes_differ() -> None:
    cache = PagedKVCache(page_size=2, capacity=8)
    tenant = CacheNamespace(lora_name="ad", lora_id=1, cache_salt="t")
    (base,) = cache.insert([1, 2, 3, 4])
    assert cache.peek([1, 2, 3, 4, 5], tenant) == 0
    (salted,) = cache.insert([1, 2, 3, 4], tenant)
    assert isinstance(base, Stored)
    assert isinstance(salted, Stored)
    assert salted.namespace == tenant
    assert salted.parent is None
    assert not set(base.hashes) & set(salted.hashes)
    assert cache.match([1, 2, 3, 4, 5], tenant).cached_tokens == 4
    assert cache.cached_chains() == [[1, 2, 3, 4]]
    assert cache.cached_chains(tenant) == [[1, 2, 3, 4]]


def test_a_namespace_goes_with_its_last_page() -> None:
    cache = PagedKVCache(page_size=2, capacity=2)
    for salt in map(str, range(50)):
        cache.insert([1, 2, 3, 4], CacheNamespace(cache_salt=salt))
    assert len(cache._roots) <= 2
