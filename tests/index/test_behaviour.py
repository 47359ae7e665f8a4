"""What every index backend must do, run against memory, fakeredis and a real Redis."""

from __future__ import annotations

import asyncio

import pytest

from globalkv.index.base import ApplyResult, Index, Source, Tier
from globalkv.keys import root_key
from tests.index.conftest import Backend
from tests.index.events import (
    BS,
    P0,
    P0_DP1,
    P1,
    Feeder,
    clear,
    depths,
    keys,
    remove,
    scores,
    store,
    tokens,
)


@pytest.fixture
def index(backend: Backend) -> Index:
    return backend.make(BS)


@pytest.fixture
def feed(index: Index) -> Feeder:
    return Feeder(index)


async def test_a_stored_chain_is_found_with_its_contiguous_depth(
    index: Index, feed: Feeder
) -> None:
    t = tokens(3)
    result = await feed(P0, store([1, 2, 3], t))
    assert result == ApplyResult(stored=3)
    hits = await index.lookup(keys(t + tokens(2, start=100)))
    assert depths(hits) == {P0: 3}
    assert scores(hits) == {P0: 3.0}
    assert await index.lookup(keys(tokens(2, start=100))) == []
    assert await index.lookup([]) == []


async def test_children_chain_through_the_parent_engine_hash(index: Index, feed: Feeder) -> None:
    t = tokens(3)
    await feed(P0, store([1], t[:BS]))
    await feed(P0, store([2, 3], t[BS:], parent=1))
    assert depths(await index.lookup(keys(t))) == {P0: 3}


async def test_an_engine_block_of_k_index_blocks_yields_k_keys(index: Index, feed: Feeder) -> None:
    t = tokens(6)
    await feed(P0, store([1, 2], t[: 4 * BS], block_size=2 * BS))
    await feed(P0, store([3], t[4 * BS :], parent=2, block_size=2 * BS))
    assert depths(await index.lookup(keys(t))) == {P0: 6}
    assert depths(await index.lookup(keys(t[: 3 * BS]))) == {P0: 3}
    await feed(P0, remove([2]))
    assert depths(await index.lookup(keys(t))) == {P0: 2}


async def test_partial_engine_blocks_are_counted_and_not_keyed(index: Index, feed: Feeder) -> None:
    t = tokens(2)
    not_whole = await feed(P0, store([1], t[: BS + 1], block_size=BS + 1))
    assert not_whole == ApplyResult(partial=1)
    mismatched = await feed(P0, store([2, 3], t[: 2 * BS - 1]))
    assert mismatched == ApplyResult(partial=2)
    assert await index.lookup(keys(t)) == []
    orphan_of_partial = await feed(P0, store([4], t[BS:], parent=1))
    assert orphan_of_partial == ApplyResult(orphans=1)


async def test_a_store_whose_parent_the_source_never_stored_is_an_orphan(
    index: Index, feed: Feeder
) -> None:
    t = tokens(2)
    await feed(P1, store([1], t[:BS]))
    result = await feed(P0, store([2, 3], t[BS:] + tokens(1, start=50), parent=1))
    assert result == ApplyResult(orphans=2)
    assert depths(await index.lookup(keys(t))) == {P1: 1}
    assert await feed(P0, store([4], tokens(1, start=70), parent=3)) == ApplyResult(orphans=1)


async def test_re_stores_of_known_hashes_change_only_the_tier(index: Index, feed: Feeder) -> None:
    t = tokens(3)
    await feed(P0, store([1], t[:BS]), store([2, 3], t[BS:], parent=1))
    # vLLM >= 0.26 re-emits cached blocks from the root with a nil parent.
    again = await feed(P0, store([1, 2, 3], t))
    assert again == ApplyResult(stored=3)
    assert depths(await index.lookup(keys(t))) == {P0: 3}
    await feed(P0, store([2], t[BS : 2 * BS], tier=Tier.CPU))
    await feed(P0, remove([2], Tier.GPU))
    hits = await index.lookup(keys(t))
    assert depths(hits) == {P0: 3}
    assert scores(hits)[P0] == pytest.approx(2.8)


async def test_removes_are_per_tier(index: Index, feed: Feeder) -> None:
    t = tokens(2)
    await feed(P0, store([1, 2], t, tier=Tier.GPU), store([1, 2], t, tier=Tier.CPU))
    await feed(P0, remove([1, 2], Tier.CPU))
    assert scores(await index.lookup(keys(t))) == {P0: 2.0}
    await feed(P0, store([1, 2], t, tier=Tier.DISK), remove([2], Tier.GPU))
    assert scores(await index.lookup(keys(t))) == {P0: pytest.approx(1.5)}
    result = await feed(P0, remove([2], Tier.DISK), remove([2], Tier.DISK), remove([99]))
    assert result == ApplyResult(removed=1)
    assert depths(await index.lookup(keys(t))) == {P0: 1}


async def test_a_key_stays_while_any_engine_block_holds_it(index: Index, feed: Feeder) -> None:
    t = tokens(2)
    await feed(P0, store([1, 2], t))
    await feed(P0, store([7, 8], t))  # same tokens under other engine hashes
    await feed(P0, remove([1, 2]))
    assert depths(await index.lookup(keys(t))) == {P0: 2}
    await feed(P0, remove([8]))
    assert depths(await index.lookup(keys(t))) == {P0: 1}
    await feed(P0, store([9], t[BS:], parent=7))  # children of the survivor still chain
    assert depths(await index.lookup(keys(t))) == {P0: 2}


async def test_depth_counts_only_blocks_contiguous_from_the_first(
    index: Index, feed: Feeder
) -> None:
    t = tokens(4)
    await feed(P0, store([1, 2, 3, 4], t))
    await feed(P1, store([1, 2, 3, 4], t))
    await feed(P0, remove([3]))
    await feed(P1, remove([1]))
    assert depths(await index.lookup(keys(t))) == {P0: 2}


async def test_hits_are_ranked_by_tier_weighted_score(backend: Backend) -> None:
    index = backend.make(BS, tier_weights={Tier.CPU: 0.25})
    feed = Feeder(index)
    t = tokens(4)
    await feed(P0, store([1, 2, 3, 4], t, tier=Tier.CPU))
    await feed(P1, store([1, 2], t[: 2 * BS], tier=Tier.GPU))
    await feed(P0_DP1, store([1, 2, 3], t[: 3 * BS], tier=Tier.DISK))
    hits = await index.lookup(keys(t))
    assert [(h.source, h.blocks) for h in hits] == [(P1, 2), (P0_DP1, 3), (P0, 4)]
    assert [h.score for h in hits] == pytest.approx([2.0, 1.5, 1.0])


async def test_clear_drops_everything_before_it_in_the_batch(index: Index, feed: Feeder) -> None:
    t = tokens(3)
    await feed(P0, store([1, 2], t[: 2 * BS]))
    await feed(P1, store([1], t[:BS]))
    result = await feed(P0, store([3], t[2 * BS :], parent=2), clear(), store([5], t[:BS]))
    assert result == ApplyResult(stored=2, cleared=1)
    assert depths(await index.lookup(keys(t))) == {P0: 1, P1: 1}
    assert await feed(P0, store([6], t[BS : 2 * BS], parent=2)) == ApplyResult(orphans=1)
    (stats,) = await index.stats(P0.pod)
    assert stats.blocks[Tier.GPU] == 1


async def test_a_reset_source_vanishes_at_once_and_starts_over(index: Index, feed: Feeder) -> None:
    t = tokens(2)
    await feed(P0, store([1, 2], t))
    await feed(P1, store([1, 2], t))
    (before,) = await index.stats(P0.pod)
    await index.reset_source(P0)
    assert depths(await index.lookup(keys(t))) == {P1: 2}
    (after,) = await index.stats(P0.pod)
    assert after.epoch > before.epoch
    assert after.resets == before.resets + 1
    assert after.blocks == {Tier.GPU: 0, Tier.CPU: 0, Tier.DISK: 0}
    assert await feed(P0, store([3], t[BS:], parent=1)) == ApplyResult(orphans=1)
    await feed(P0, store([1], t[:BS]))
    assert depths(await index.lookup(keys(t))) == {P0: 1, P1: 2}


async def test_remove_pod_forgets_every_dp_rank_of_that_pod(index: Index, feed: Feeder) -> None:
    t = tokens(2)
    for source in (P0, P0_DP1, P1):
        await feed(source, store([1, 2], t))
    await index.remove_pod("p0")
    assert depths(await index.lookup(keys(t))) == {P1: 2}
    assert [s.source for s in await index.stats()] == [P1]
    await index.remove_pod("unknown")
    await feed(P0, store([1], t[:BS]))
    assert depths(await index.lookup(keys(t))) == {P0: 1, P1: 2}


async def test_stats_report_blocks_by_tier_and_the_last_batch(index: Index, feed: Feeder) -> None:
    t = tokens(3)
    await feed(P0, store([1, 2, 3], t), ts=10.5)
    await feed(P0, store([2], t[BS : 2 * BS], tier=Tier.CPU), ts=11.25)
    await feed(P1, store([1], t[:BS], tier=Tier.DISK), ts=3.0)
    stats = {s.source: s for s in await index.stats()}
    assert stats[P0].blocks == {Tier.GPU: 3, Tier.CPU: 1, Tier.DISK: 0}
    assert (stats[P0].last_seq, stats[P0].last_event_ts) == (1, 11.25)
    assert stats[P1].blocks == {Tier.GPU: 0, Tier.CPU: 0, Tier.DISK: 1}
    assert stats[P0].resets == 0
    assert [s.source for s in await index.stats("p1")] == [P1]


async def test_token_ids_outside_u32_are_counted_not_fatal(index: Index, feed: Feeder) -> None:
    result = await feed(P0, store([1], [1, 2, 3, 2**32]), store([2], tokens(1)))
    assert result == ApplyResult(stored=1, invalid=1)
    assert depths(await index.lookup(keys(tokens(1)))) == {P0: 1}


async def test_namespaces_do_not_share_keys(index: Index, feed: Feeder) -> None:
    t = tokens(2)
    lora = root_key("m", "adapter")
    await feed(P0, store([1, 2], t))
    await feed(P1, store([1, 2], t, namespace=lora))
    assert depths(await index.lookup(keys(t))) == {P0: 2}
    assert depths(await index.lookup(keys(t, lora))) == {P1: 2}


async def test_sources_are_applied_concurrently(index: Index) -> None:
    feed = Feeder(index)
    t = tokens(8)
    sources = [Source(f"p{i}", dp) for i in range(4) for dp in range(2)]

    async def write(source: Source) -> None:
        for n in range(8):
            parent = None if n == 0 else n
            await feed(source, store([n + 1], t[n * BS : (n + 1) * BS], parent=parent))

    await asyncio.gather(*(write(s) for s in sources))
    assert depths(await index.lookup(keys(t))) == dict.fromkeys(sources, 8)


async def test_long_chains_with_many_holders(index: Index, feed: Feeder) -> None:
    t = tokens(300)
    sources = [Source(f"p{i}") for i in range(12)]
    for i, source in enumerate(sources):
        held = 25 * (i + 1)
        await feed(source, store(range(1, held + 1), t[: held * BS]))
    await feed(sources[3], store([1000], t[:BS], tier=Tier.CPU), remove([50]))
    hits = await index.lookup(keys(t))
    expected = {s: 25 * (i + 1) for i, s in enumerate(sources)}
    expected[sources[3]] = 49
    assert depths(hits) == expected
    assert scores(hits)[sources[3]] == pytest.approx(49.0)
    assert [h.source for h in hits] == sorted(expected, key=lambda s: -expected[s])


async def test_runs_across_many_segments_join_as_one_contiguous_prefix(
    index: Index, feed: Feeder
) -> None:
    """A chain past the head segments (on a cluster, segments alternate between masters):
    tiers change and runs end on later segments, and a later segment's holders that miss an
    earlier block do not count beyond it."""
    t = tokens(600)
    full, offload, hole, evicted, tail_only = (
        Source(n) for n in ("full", "off", "hole", "ev", "tail")
    )
    await feed(full, store(range(1, 601), t))
    await feed(
        offload,
        store(range(1, 101), t[: 100 * BS]),
        store(range(101, 301), t[100 * BS : 300 * BS], parent=100, tier=Tier.CPU),
    )
    await feed(hole, store(range(1, 601), t), remove([41]))  # block 40 missing
    await feed(evicted, store(range(1, 601), t), remove([401]))
    await feed(tail_only, store(range(1, 601), t), remove([1]))
    await feed(P0, store(range(1, 601), t))
    await feed(P0, clear())  # a source that dropped everything is not reported
    hits = await index.lookup(keys(t))
    assert depths(hits) == {full: 600, offload: 300, hole: 40, evicted: 400}
    assert scores(hits)[offload] == pytest.approx(100 + 200 * 0.8)


async def test_runs_that_end_alone_together_or_change_tier(index: Index, feed: Feeder) -> None:
    t = tokens(12)
    await feed(P0, store(range(1, 13), t))
    await feed(P1, store(range(1, 7), t[: 6 * BS]))
    await feed(P0_DP1, store(range(1, 7), t[: 6 * BS]))  # ends with P1
    late = Source("late")
    await feed(late, store(range(1, 10), t[: 9 * BS]), remove([4]))  # holds 5..9 past a hole
    offload = Source("offload")
    await feed(
        offload,
        store(range(1, 4), t[: 3 * BS]),
        store(range(4, 9), t[3 * BS : 8 * BS], parent=3, tier=Tier.CPU),
    )
    hits = await index.lookup(keys(t))
    assert depths(hits) == {P0: 12, P1: 6, P0_DP1: 6, late: 3, offload: 8}
    assert scores(hits)[offload] == pytest.approx(3 + 5 * 0.8)


async def test_fingerprints_of_many_holders_stay_exact(index: Index, feed: Feeder) -> None:
    """Some hundred holders of a block sum their 48-bit fields past a double's 2^53."""
    t = tokens(100)
    sources = [Source(f"p{i}") for i in range(100)]
    for i, source in enumerate(sources):
        await feed(source, store(range(1, i + 2), t[: (i + 1) * BS]))
    hits = await index.lookup(keys(t))
    assert depths(hits) == {s: i + 1 for i, s in enumerate(sources)}


async def test_equal_hits_are_ordered_by_pod_then_dp_rank(index: Index, feed: Feeder) -> None:
    t = tokens(2)
    sources = [Source("b"), Source("a", 10), Source("a", 2), Source("a"), Source("c", 1)]
    for source in sources:
        await feed(source, store([1, 2], t))
    hits = await index.lookup(keys(t))
    assert [h.source for h in hits] == sorted(sources)
    assert [(h.source.pod, h.source.dp_rank) for h in hits] == [
        ("a", 0), ("a", 2), ("a", 10), ("b", 0), ("c", 1)
    ]  # fmt: skip
