"""What only the memory backend promises: its bound, and its bookkeeping."""

from __future__ import annotations

import pytest

from globalkv.index.base import ApplyResult, Source, Tier
from globalkv.index.memory import MemoryIndex
from tests.index.events import BS, P0, P1, Feeder, clear, depths, keys, remove, store, tokens


async def test_stores_beyond_the_bound_are_skipped_and_counted() -> None:
    index = MemoryIndex(BS, max_entries=5)
    feed = Feeder(index)
    t = tokens(4)
    assert await feed(P0, store([1, 2, 3], t[: 3 * BS])) == ApplyResult(stored=3)
    over = await feed(P1, store([1, 2, 3], t[: 3 * BS]))
    assert over == ApplyResult(stored=2, over_capacity=1)
    assert index.entries == 5
    assert depths(await index.lookup(keys(t))) == {P0: 3, P1: 2}
    # Its children are orphans now: their parent was never indexed.
    assert await feed(P1, store([4], t[3 * BS :], parent=3)) == ApplyResult(orphans=1)
    # Another tier of a held block takes no room; another engine block naming a held key
    # is one more block to keep, and the bound is reached.
    held = await feed(P0, store([1], t[:BS], tier=Tier.CPU), store([9], t[:BS]))
    assert held == ApplyResult(stored=1, over_capacity=1)
    assert index.entries == 5


async def test_engine_blocks_naming_held_keys_count_against_the_bound() -> None:
    index = MemoryIndex(BS, max_entries=4)
    feed = Feeder(index)
    t = tokens(2)
    assert await feed(P0, store([1], t[:BS])) == ApplyResult(stored=1)
    # One key, under ever new engine hashes (a page stored again, or a sender's invention).
    result = await feed(P0, *(store([h], t[:BS]) for h in range(2, 10)))
    assert result == ApplyResult(stored=3, over_capacity=5)
    assert index.entries == 1
    assert len(index._states[P0].blocks) == 4
    # A wide engine block too: two keys, but no room for one more block.
    assert await feed(P0, store([10], t, block_size=2 * BS)) == ApplyResult(over_capacity=1)
    assert await feed(P0, remove([2])) == ApplyResult(removed=1)  # frees a block's room
    assert await feed(P0, store([11], t[:BS])) == ApplyResult(stored=1)


async def test_removes_clears_and_resets_free_room() -> None:
    index = MemoryIndex(BS, max_entries=4)
    feed = Feeder(index)
    t = tokens(4)
    await feed(P0, store([1, 2, 3, 4], t))
    assert await feed(P1, store([1], t[:BS])) == ApplyResult(over_capacity=1)
    assert await feed(P0, remove([4]), store([4], t[3 * BS :], parent=3)) == ApplyResult(
        stored=1, removed=1
    )
    result = await feed(P0, clear(), store([1, 2], t[: 2 * BS]))
    assert result == ApplyResult(stored=2, cleared=1)
    assert await feed(P1, store([1, 2, 3], t[: 3 * BS])) == ApplyResult(stored=2, over_capacity=1)
    await index.reset_source(P0)
    assert index.entries == 2
    assert await feed(P1, store([3], t[2 * BS : 3 * BS], parent=2)) == ApplyResult(stored=1)
    await index.remove_pod("p1")
    assert index.entries == 0


async def test_a_multi_key_engine_block_is_skipped_whole() -> None:
    index = MemoryIndex(BS, max_entries=3)
    feed = Feeder(index)
    t = tokens(4)
    result = await feed(P0, store([1, 2], t, block_size=2 * BS))
    assert result == ApplyResult(stored=1, over_capacity=1)
    assert index.entries == 2


async def test_slots_of_removed_pods_are_reused() -> None:
    index = MemoryIndex(BS)
    feed = Feeder(index)
    t = tokens(2)
    for i in range(40):
        await feed(Source(f"old{i}"), store([1, 2], t))
    for i in range(40):
        await index.remove_pod(f"old{i}")
    await feed(P0, store([1, 2], t))
    await feed(P1, store([1], t[:BS]))
    assert depths(await index.lookup(keys(t))) == {P0: 2, P1: 1}
    assert max(index._slot_of.values()) == 1


async def test_close_forgets_everything() -> None:
    index = MemoryIndex(BS)
    await Feeder(index)(P0, store([1], tokens(1)))
    await index.close()
    assert await index.lookup(keys(tokens(1))) == []
    assert await index.stats() == []
    assert index.entries == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 0}, "block_size"),
        ({"block_size": 4, "max_entries": -1}, "max_entries"),
        ({"block_size": 4, "tier_weights": {Tier.CPU: float("nan")}}, "weight of CPU"),
        ({"block_size": 4, "tier_weights": {"CPU": 1.0}}, "keyed by Tier"),
    ],
)
def test_configuration_is_checked(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MemoryIndex(**kwargs)  # type: ignore[arg-type]
