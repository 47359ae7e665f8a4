"""The prompts a gateway sent and the index cannot show yet: table, tracker, policy."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from random import Random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.load.pending import PendingHit, PendingPrefixes
from gateway.load.tracker import Candidate, LoadTracker
from gateway.policies import Choice, build_policy
from gateway.requests.query import RouteQuery
from gateway.settings.routing import PrefixWeights
from globalkv.keys import request_keys
from globalkv.lookup import LookupResult, PodHit


def blocks(found: Mapping[str, PendingHit]) -> dict[str, int]:
    return {worker: hit.blocks for worker, hit in found.items()}


def test_depth_is_the_contiguous_run_of_leading_keys_per_worker() -> None:
    table = PendingPrefixes()
    table.add("a", [1, 2, 3, 4])
    table.add("b", [1, 2, 9])
    table.add("c", [7, 8])
    assert blocks(table.depths([1, 2, 3, 5], now=0.0)) == {"a": 3, "b": 2}
    assert blocks(table.depths([1, 2, 9, 10], now=0.0)) == {"a": 2, "b": 3}
    assert blocks(table.depths([7, 8, 1], now=0.0)) == {"c": 2}
    assert table.depths([], now=0.0) == {}


prompts = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c"]),
        st.lists(st.integers(0, 2), min_size=0, max_size=40),
    ),
    max_size=8,
)


@given(prompts, st.lists(st.integers(0, 2), max_size=40), st.integers(0, 200))
def test_depths_agree_with_a_walk_over_real_key_chains(
    sent: list[tuple[str, list[int]]], asked: list[int], max_keys: int
) -> None:
    """Chained keys of 2-token blocks over a 3-token alphabet share prefixes often; the
    binary search must find what walking each kept chain from its start finds."""
    table = PendingPrefixes(max_keys=max_keys)
    kept: list[tuple[str, Sequence[int]]] = []
    for worker, tokens in sent:
        chain = request_keys(tokens, 2, "m")
        entry = table.add(worker, chain)
        kept.append((worker, chain[: len(entry.keys)]))
    query = request_keys(asked, 2, "m")
    expected: dict[str, int] = {}
    for worker, chain in kept:
        depth = 0
        while depth < min(len(chain), len(query)) and chain[depth] == query[depth]:
            depth += 1
        if depth:
            expected[worker] = max(expected.get(worker, 0), depth)
    assert blocks(table.depths(query, now=0.0)) == expected
    assert table.keys == sum(len(chain) for _, chain in kept) <= max_keys


def test_a_settled_entry_lasts_the_grace_and_a_shared_key_outlives_one_holder() -> None:
    table = PendingPrefixes(grace_s=2.0)
    first = table.add("a", [1, 2])
    table.add("a", [1, 2, 3])
    table.settle(first, now=10.0)
    assert blocks(table.depths([1, 2, 3], now=11.9)) == {"a": 3}
    table.expire(12.0)
    assert table.keys == 3, "the other prompt still holds them"
    assert blocks(table.depths([1, 2, 3], now=12.0)) == {"a": 3}
    table.settle(first, now=20.0)
    table.expire(30.0)
    assert table.keys == 3, "settling twice removes once"


def test_grace_zero_removes_at_once_and_forget_drops_a_worker() -> None:
    table = PendingPrefixes(grace_s=0.0)
    entry = table.add("a", [1, 2])
    table.add("b", [1], dp_rank=3)
    table.settle(entry, now=0.0)
    assert table.depths([1, 2], now=0.0) == {"b": PendingHit(1, 3)}
    table.forget("b")
    assert table.depths([1, 2], now=0.0) == {}
    assert table.keys == 0


def test_the_key_bound_keeps_the_prefix_that_fits() -> None:
    table = PendingPrefixes(max_keys=3)
    table.add("a", [1, 2])
    table.add("b", [1, 2, 3])
    assert table.keys == 3
    assert blocks(table.depths([1, 2, 3], now=0.0)) == {"a": 2, "b": 1}
    assert table.add("c", [1]).first is None, "a full table keeps nothing more"


def test_negative_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="must not be negative"):
        PendingPrefixes(grace_s=-1)


def test_the_tracker_records_keys_until_the_grace_after_prefill_done() -> None:
    now = [0.0]
    loads = LoadTracker(pending=PendingPrefixes(grace_s=1.0), clock=lambda: now[0])
    ticket = loads.start_prefill(Choice("p", uncached_tokens=100), [5, 6], 1)
    assert loads.pending_blocks([5, 6, 7]) == {"p": PendingHit(2, 1)}
    now[0] = 3.0
    loads.finish(ticket)
    assert blocks(loads.pending_blocks([5, 6])) == {"p": 2}
    now[0] = 4.0
    assert loads.pending_keys() == 0, "expired when counted, without a lookup"
    assert loads.pending_blocks([5, 6]) == {}
    failed = loads.start_prefill(Choice("p", uncached_tokens=100), [5, 6])
    loads.finish(failed, computed=False)
    assert loads.pending_blocks([5, 6]) == {}, "a prefill that failed holds nothing"
    gone = loads.start_prefill(Choice("q", uncached_tokens=100), [5, 6])
    loads.forget("q")
    assert loads.pending_keys() == 0, "a removed worker holds nothing"
    loads.finish(gone)
    untracked = LoadTracker(pending=None)
    untracked.start_prefill(Choice("p", uncached_tokens=100), [5, 6])
    assert untracked.pending_blocks([5, 6]) == {}
    assert untracked.pending_keys() == 0


def test_prefix_counts_what_it_sent_where_the_index_shows_less() -> None:
    """The index shows 160 tokens on pod-b; 40 blocks (640 tokens) were sent to a's rank 2."""
    policy = build_policy("prefix", Random(0), prefix=PrefixWeights(queued_weight=1.0))
    lookup = LookupResult(16, 62, [PodHit("pod-b", 1, 10, 160, 10.0)], keys=list(range(62)))
    request = RouteQuery(tokens=[1] * 1000, lookup=lookup, pending={"a": PendingHit(40, 2)})
    candidates = [Candidate("a", "pod-a"), Candidate("b", "pod-b")]
    choice = policy.choose(request, candidates)
    assert (choice.worker, choice.hit_tokens, choice.uncached_tokens) == ("a", 640, 360)
    assert choice.dp_rank == 2, "the room must select the rank computing the prefix"
    loaded = [Candidate("a", "pod-a", 1, 600, 600), Candidate("b", "pod-b")]
    assert policy.choose(request, loaded).worker == "b", "what was sent weighs like a hit"
    lighter = build_policy("prefix", Random(0), prefix=PrefixWeights(queued_weight=0.5))
    assert lighter.choose(request, loaded).worker == "a"
    shorter = RouteQuery(tokens=[1] * 1000, lookup=lookup, pending={"b": PendingHit(5, 0)})
    held = policy.choose(shorter, candidates)
    assert (held.worker, held.hit_tokens, held.dp_rank) == ("b", 160, 1), "the index's longer"
