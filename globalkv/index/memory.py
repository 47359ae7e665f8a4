"""The embedded index, and the reference every other backend is tested against.

Each source gets a small slot number; each key maps to an int whose bits are the slots
holding it. A lookup then walks the chain with one dict probe per block, whatever the
number of sources, and stops when no source continues (hashing a lazy `KeyChain` no
further): the per-source work happens only where a source's run ends. Tiers cost nothing
while every holder of a key has it on the GPU only; keys held otherwise are listed in a
second, usually empty, map and scored from the holder's own mask.

Memory bound (`max_entries`, counted in (key, source) pairs): when a store would exceed
it, that store and the rest of its event are skipped and counted as `over_capacity`; a
source's engine blocks are bounded alike by the room its keys may take (several engine
hashes may name one key, and each is kept, so keys alone would not bound its memory),
while removes, clears and resets keep freeing room. Why not evict instead: engines
report their own evictions, so a correctly sized index mirrors what they hold and never
reaches the bound; reaching it means lost removes or an undersized bound, and evicting
from the index would punch holes into other chains (a hit must be contiguous) and cost an
LRU record per entry — the very memory the bound protects. Skipping keeps every answer
true (fewer hits, never wrong ones) and is visible in metrics; a source's reset, which
ingest does after lost events, frees what it held. Children of a skipped block are
counted as orphans, since their parent is then unknown.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import chain

from globalkv.index.base import (
    ApplyResult,
    Hit,
    Source,
    SourceBatch,
    SourceStats,
    Tier,
)
from globalkv.index.batch_changes import BatchChanges
from globalkv.index.scoring import TierWeights, make_hit, ranked, source_order
from globalkv.index.state import SourceState
from globalkv.keys import BlockKey, KeyChain

_GPU_ONLY = int(Tier.GPU)
_SMALL_INTS = 257
"""CPython keeps one object per int below this."""
APPLY_SLICE = 1024
"""Events applied between two turns of the event loop: about 15 ms."""
_SHARED_SETS = 65_536
"""Distinct slot sets `MemoryIndex._shared` keeps before it starts over."""


def _bits(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _set_bit(table: dict[BlockKey, int], key: BlockKey, bit: int, on: bool) -> None:
    old = table.get(key, 0)
    new = old | bit if on else old & ~bit
    if new != old:
        if new:
            table[key] = new
        else:
            del table[key]


class MemoryIndex:
    """An `Index` in this process's memory."""

    def __init__(
        self,
        block_size: int,
        *,
        max_entries: int | None = None,
        tier_weights: Mapping[Tier, float] | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        if max_entries is not None and max_entries < 0:
            raise ValueError("max_entries must be >= 0 (or None for no bound)")
        self.block_size = block_size
        self.max_entries = max_entries
        self._weights = TierWeights(tier_weights)
        self._held: dict[BlockKey, int] = {}
        """Key -> slots holding it in any tier."""
        self._shared: dict[int, int] = {}
        """One int object per slot set in `_held` (with more than 8 sources those are not
        CPython's cached small ints): keys held by the same sources share it, which saves
        an object per key, and a walk over thousands of keys reads a few hot objects, not
        one cold object each (3-9% of a 128k-token lookup over 64 pods after other work
        evicted the index from the caches). Cleared when large: it only shares."""
        self._mixed: dict[BlockKey, int] = {}
        """Key -> slots holding it in a tier mask other than GPU only."""
        self._states: dict[Source, SourceState] = {}
        self._slot_of: dict[Source, int] = {}
        self._by_slot: list[Source | None] = []
        self._free_slots: list[int] = []
        self._entries = 0

    @property
    def entries(self) -> int:
        """(key, source) pairs held: what `max_entries` bounds."""
        return self._entries

    # ------------------------------------------------------------------- writes

    async def apply(self, batch: SourceBatch) -> ApplyResult:
        """`APPLY_SLICE` events at a time, the event loop running in between: a batch of
        65,536 events is about a second of work. A lookup meanwhile sees the source as it
        was part way through the batch, a state the engine itself passed through."""
        state = self._state(batch.source)
        result = ApplyResult()
        events = batch.events
        for start in range(0, max(len(events), 1), APPLY_SLICE):
            if start:
                await asyncio.sleep(0)
            held = len(state.masks)
            room = None if self.max_entries is None else self.max_entries - self._entries + held
            part = events[start : start + APPLY_SLICE]
            changes = state.apply(part, self.block_size, result, room)
            self._index(self._slot_of[batch.source], state, changes)
            self._entries += len(state.masks) - held
            if changes.cleared:
                state.epoch += 1
        state.last_seq = batch.seq
        state.last_ts = batch.ts
        return result

    async def reset_source(self, source: Source) -> None:
        state = self._state(source)
        self._drop_all(source, state)
        state.epoch += 1
        state.resets += 1

    async def remove_pod(self, pod: str) -> None:
        for source in [s for s in self._states if s.pod == pod]:
            self._drop_all(source, self._states.pop(source))
            slot = self._slot_of.pop(source)
            self._by_slot[slot] = None
            heapq.heappush(self._free_slots, slot)

    async def close(self) -> None:
        for pod in {s.pod for s in self._states}:
            await self.remove_pod(pod)

    def _state(self, source: Source) -> SourceState:
        state = self._states.get(source)
        if state is None:
            state = self._states[source] = SourceState(epoch=1)
            if self._free_slots:
                slot = heapq.heappop(self._free_slots)
                self._by_slot[slot] = source
            else:
                slot = len(self._by_slot)
                self._by_slot.append(source)
            self._slot_of[source] = slot
        return state

    def _index(self, slot: int, state: SourceState, changes: BatchChanges) -> None:
        bit = 1 << slot
        held, mixed = self._held, self._mixed
        mask_of, holders, mixed_holders = state.masks.get, held.get, mixed.get
        if len(self._shared) > _SHARED_SETS:
            self._shared.clear()
        shared = self._shared.setdefault
        for key in chain(changes.stale, changes.keys) if changes.stale else changes.keys:
            mask = mask_of(key, 0)
            if not mask:
                _set_bit(held, key, bit, False)
                _set_bit(mixed, key, bit, False)
                continue
            slots = holders(key, 0)
            if not slots & bit:
                slots |= bit
                held[key] = slots if slots < _SMALL_INTS else shared(slots, slots)
            if mask != _GPU_ONLY:
                mixed[key] = mixed_holders(key, 0) | bit
            elif mixed and mixed_holders(key, 0) & bit:
                _set_bit(mixed, key, bit, False)

    def _drop_all(self, source: Source, state: SourceState) -> None:
        bit = 1 << self._slot_of[source]
        for key in state.masks:
            _set_bit(self._held, key, bit, False)
            _set_bit(self._mixed, key, bit, False)
        self._entries -= len(state.masks)
        state.clear()

    # -------------------------------------------------------------------- reads

    async def lookup(self, keys: Sequence[BlockKey]) -> list[Hit]:
        if not keys:
            return []
        # A chain given lazily is hashed only as far as some source holds it.
        walk = keys.hashed() if isinstance(keys, KeyChain) else iter(keys)
        if self._mixed:
            return self._lookup_mixed(walk)
        ends = self._ends(walk)
        # Every holder has every hit block on the GPU only: the score is the depth times
        # one weight, and `ends` is ordered by depth already.
        weight = self._weights.by_mask[_GPU_ONLY]
        by_slot = self._by_slot
        hits: list[Hit] = []
        for depth, slots in reversed(ends):
            score = weight * depth
            if not slots & (slots - 1):  # one source: no sort
                source = by_slot[slots.bit_length() - 1]
                assert source is not None
                hits.append(Hit(source, depth, score))
                continue
            group = []
            while slots:
                low = slots & -slots
                group.append(by_slot[low.bit_length() - 1])
                slots ^= low
            group.sort(key=source_order)
            for source in group:
                assert source is not None
                hits.append(Hit(source, depth, score))
        return hits

    def _ends(self, keys: Iterator[BlockKey]) -> list[tuple[int, int]]:
        """(depth, slots whose contiguous run ends there), by increasing depth.

        One dict probe per block, and an AND only where its holders differ from the running
        set, whatever the number of sources. (A C-level `accumulate` over chunks, or `map`
        over the keys, measured slower than this loop on CPython 3.11.)
        """
        held = self._held.get
        active = held(next(keys), 0)
        ends: list[tuple[int, int]] = []
        if not active:
            return ends
        depth = 1
        for key in keys:
            slots = held(key, 0)
            if slots != active:  # usually equal; an AND allocates an int past 8 slots
                now = slots & active
                if now != active:
                    ends.append((depth, active ^ now))
                    active = now
                    if not now:
                        return ends
            depth += 1
        ends.append((depth, active))
        return ends

    def _lookup_mixed(self, keys: Iterator[BlockKey]) -> list[Hit]:
        """A lookup where some holders hold some keys in other tiers than the GPU alone."""
        held, mixed = self._held.get, self._mixed.get
        first = next(keys)
        active = held(first, 0)
        if not active:
            return []
        ends: list[tuple[int, int]] = []
        off_gpu: dict[int, dict[int, int]] = {}
        """slot -> {mask -> hit blocks it holds under that mask, other than GPU only}"""
        depth = 0
        for key in chain((first,), keys):
            slots = held(key, 0)
            if slots != active:
                now = slots & active
                if now != active:
                    ends.append((depth, active ^ now))
                    active = now
                    if not now:
                        break
            off = mixed(key, 0) & active
            for slot in _bits(off) if off else ():
                source = self._by_slot[slot]
                assert source is not None
                mask = self._states[source].masks[key]
                counts = off_gpu.setdefault(slot, {})
                counts[mask] = counts.get(mask, 0) + 1
            depth += 1
        if active:
            ends.append((depth, active))
        hits = []
        for depth, slots in ends:
            for slot in _bits(slots):
                source = self._by_slot[slot]
                assert source is not None
                counts = off_gpu.get(slot, {})
                gpu_only = depth - sum(counts.values())
                hits.append(make_hit(source, {_GPU_ONLY: gpu_only, **counts}, self._weights))
        return ranked(hits)

    async def stats(self, pod: str | None = None) -> list[SourceStats]:
        return [
            SourceStats(
                source=source,
                epoch=state.epoch,
                blocks={Tier(bit): count for bit, count in state.counts.items()},
                last_seq=state.last_seq,
                last_event_ts=state.last_ts,
                resets=state.resets,
            )
            for source, state in sorted(self._states.items())
            if pod is None or source.pod == pod
        ]
