"""The state behind both backends: atomic batches, and blocks packed into plain ints."""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from globalkv.index import state as state_module
from globalkv.index.base import ApplyResult, IndexEvent, Tier
from globalkv.index.memory import MemoryIndex
from globalkv.index.packing import EngineBlock, pack_block, unpack_block
from globalkv.index.state import SourceState
from globalkv.keys import BlockKey
from tests.index.conftest import Backend
from tests.index.events import BS, P0, P1, Feeder, clear, depths, keys, remove, store, tokens


def _failing_on_call(n: int) -> Callable[..., Any]:
    real = state_module.chain_keys
    calls = 0

    def chain_keys(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == n:
            raise RuntimeError("keying failed")
        return real(*args)

    return chain_keys


def _snapshot(state: SourceState) -> tuple[Any, ...]:
    return copy.deepcopy((state.blocks, state.masks, state.extra, state.counts))


T = tokens(4)
BATCHES: dict[str, list[IndexEvent]] = {
    "before a clear": [
        store([3], T[2 * BS : 3 * BS], parent=2, tier=Tier.CPU),
        remove([1]),
        store([5], T[:BS]),
    ],
    "after a clear": [remove([2]), store([7], T[:BS]), clear(), store([8], T[:BS])],
    "between clears": [clear(), store([8], T[:BS]), clear(), store([9], T[:BS])],
}


@pytest.mark.parametrize("events", BATCHES.values(), ids=list(BATCHES))
def test_rollback_restores_the_state_exactly(
    monkeypatch: pytest.MonkeyPatch, events: list[IndexEvent]
) -> None:
    state = SourceState()
    state.apply([store([1, 2], T[: 2 * BS]), store([6], T[:BS])], BS, ApplyResult())
    before = _snapshot(state)
    monkeypatch.setattr(state_module, "chain_keys", _failing_on_call(2))
    with pytest.raises(RuntimeError):
        state.apply(events, BS, ApplyResult())
    assert _snapshot(state) == before


async def test_a_failed_batch_changes_nothing_visible(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = backend.make(BS)
    feed = Feeder(index)
    await feed(P0, store([1, 2], T[: 2 * BS]))
    await feed(P1, store([1], T[:BS]))
    monkeypatch.setattr(state_module, "chain_keys", _failing_on_call(2))
    with pytest.raises(RuntimeError):
        await feed(P0, remove([2]), clear(), store([3], T[:BS]), store([4], T[BS : 2 * BS]))
    monkeypatch.undo()
    assert depths(await index.lookup(keys(T))) == {P0: 2, P1: 1}
    (stats,) = await index.stats("p0")
    assert stats.blocks[Tier.GPU] == 2
    assert await feed(P0, store([3], T[2 * BS : 3 * BS], parent=2)) == ApplyResult(stored=1)
    assert depths(await index.lookup(keys(T))) == {P0: 3, P1: 1}


@given(
    keys=st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=6),
    root=st.integers(0, 2**64 - 1),
    tiers=st.integers(1, 7),
    depth=st.integers(0, 2**32 - 7),
)
def test_an_engine_block_packs_into_one_int_and_back(
    keys: list[int], root: int, tiers: int, depth: int
) -> None:
    block = EngineBlock(tuple(map(BlockKey, keys)), BlockKey(root), tiers, depth)
    word = pack_block(block)
    assert unpack_block(word) == block
    assert unpack_block(word ^ tiers | 4) == block._replace(tiers=4)


async def test_nothing_per_block_is_tracked_by_the_garbage_collector() -> None:
    """Full collections walk every tracked object: millions of blocks made them 50 ms."""
    index = MemoryIndex(BS)
    feed = Feeder(index)
    t = tokens(6)
    await feed(
        P0, store([1, 2, 3], t[: 3 * BS]), store([4], t[3 * BS :], parent=3, block_size=3 * BS)
    )
    await feed(P1, store([1, 2], t[: 2 * BS]), store([2], t[BS : 2 * BS], tier=Tier.CPU))
    await feed(P1, store([9], t[:BS]))  # an alias: an extra holder of the first key
    state = index._states[P1]
    assert state.extra
    tables = [index._held, index._mixed]
    for source_state in index._states.values():
        tables += [source_state.blocks, source_state.masks, source_state.extra]
    assert not any(gc.is_tracked(table) for table in tables)
    assert not any(gc.is_tracked(v) for table in tables for v in table.values())
