"""What one source holds, and the one code path that turns its events into key changes.

Both backends apply a batch through `SourceState.apply`, so they differ only in how they
store the result. The state is the source's `engine hash -> keys` map plus, derived from
it, the tier mask of every key the source holds:

- Parents resolve through the source's own map: a parent hash means nothing elsewhere.
  A store whose parent the source does not hold is an orphan (skipped, counted), as in
  llm-d and Dynamo: its keys cannot be placed in a chain.
- An engine block of k index blocks yields k keys; children chain from the last one. An
  engine block that is not whole index blocks (a partial page, or a store whose tokens do
  not match its hashes) is counted as partial and not keyed.
- A known engine hash re-stored is a no-op except for its tier: vLLM re-emits stores for
  prefix-cache hits (with a nil parent, correctly: they start at the root), and the keys
  computed at the first store stay authoritative.
- Several engine hashes may name the same key (extra keys the gateway cannot see, a page
  stored again under another hash); a key stays held in a tier while any of them holds
  it there, so a remove never hides a block the source still has.

A batch is atomic: `apply` records enough to `rollback` an exception half-way, and
reports what changed (`BatchChanges`) for the backend to store.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from globalkv.index.base import (
    ApplyResult,
    ClearSource,
    IndexEvent,
    RemoveBlocks,
    StoreBlocks,
    Tier,
)
from globalkv.keys import BlockKey, EngineHash, chain_keys, token_bytes

TIER_BITS: tuple[int, ...] = tuple(int(t) for t in Tier)


class EngineBlock(NamedTuple):
    """One engine block as the source stored it."""

    keys: tuple[BlockKey, ...]
    root: BlockKey
    """First key of the chain; Redis tags block keys with it so a chain shares a slot."""
    tiers: int


class BatchChanges:
    """What a batch changed, for the backend to store; also the batch's undo record."""

    __slots__ = (
        "_block_undo",
        "_counts_undo",
        "_extra_undo",
        "_mask_undo",
        "_snapshot",
        "blocks",
        "cleared",
        "keys",
        "stale",
    )

    def __init__(self, counts: dict[int, int]) -> None:
        self.cleared = False
        """The source was cleared first; `keys` and `blocks` are relative to empty."""
        self.keys: dict[BlockKey, BlockKey] = {}
        """Keys whose mask may differ (since the last clear), with their chain root."""
        self.blocks: set[EngineHash] = set()
        """Engine blocks added, changed or dropped (since the last clear)."""
        self.stale: set[BlockKey] = set()
        """Keys held or touched before a clear of this batch (to un-index in memory)."""
        self._mask_undo: dict[BlockKey, int] = {}
        self._block_undo: dict[EngineHash, EngineBlock | None] = {}
        self._extra_undo: dict[tuple[BlockKey, int], int] = {}
        self._counts_undo = dict(counts)
        self._snapshot: (
            tuple[
                dict[EngineHash, EngineBlock],
                dict[BlockKey, int],
                dict[tuple[BlockKey, int], int],
            ]
            | None
        ) = None

    def stored_mask(self, key: BlockKey) -> int:
        """A changed key's mask before the batch, as the backend still stores it."""
        return 0 if self.cleared else self._mask_undo[key]


class SourceState:
    """One source's blocks; the same for the memory index and a Redis writer's cache."""

    __slots__ = ("blocks", "counts", "epoch", "extra", "last_seq", "last_ts", "masks", "resets")

    def __init__(self, epoch: int = 0, resets: int = 0) -> None:
        self.blocks: dict[EngineHash, EngineBlock] = {}
        self.masks: dict[BlockKey, int] = {}
        """Key -> tiers this source holds it in (the union over its engine blocks)."""
        self.extra: dict[tuple[BlockKey, int], int] = {}
        """(key, tier) -> engine blocks beyond the first holding the key in that tier."""
        self.counts: dict[int, int] = dict.fromkeys(TIER_BITS, 0)
        """Tier bit -> keys held in that tier."""
        self.epoch = epoch
        self.resets = resets
        self.last_seq: int | None = None
        self.last_ts: float | None = None

    @classmethod
    def restore(
        cls, blocks: Iterable[tuple[EngineHash, EngineBlock]], epoch: int, resets: int
    ) -> SourceState:
        """Rebuild from stored engine blocks (a Redis writer after a restart)."""
        state = cls(epoch, resets)
        changes = BatchChanges(state.counts)
        changes._snapshot = ({}, {}, {})  # nothing to undo: the state is new
        for engine_hash, block in blocks:
            for bit in TIER_BITS:
                if block.tiers & bit:
                    state._add(block.keys, block.root, bit, changes)
            state.blocks[engine_hash] = block
        return state

    # ------------------------------------------------------------------ batches

    def apply(
        self,
        events: Sequence[IndexEvent],
        block_size: int,
        result: ApplyResult,
        max_keys: int | None = None,
    ) -> BatchChanges:
        """Apply a batch's events in order; the state is unchanged if this raises.

        `max_keys` bounds how many keys the source may hold when the batch ends a store;
        stores beyond it are skipped and counted as over capacity.
        """
        changes = BatchChanges(self.counts)
        try:
            for event in events:
                if isinstance(event, StoreBlocks):
                    self._store(event, block_size, result, changes, max_keys)
                elif isinstance(event, RemoveBlocks):
                    self._remove(event, result, changes)
                elif isinstance(event, ClearSource):
                    self._clear(changes)
                    result.cleared += 1
        except BaseException:
            self.rollback(changes)
            raise
        return changes

    def rollback(self, changes: BatchChanges) -> None:
        """Undo a batch that could not be stored."""
        if changes._snapshot is not None:
            self.blocks, self.masks, self.extra = changes._snapshot
        for key, mask in changes._mask_undo.items():
            if mask:
                self.masks[key] = mask
            else:
                self.masks.pop(key, None)
        for engine_hash, block in changes._block_undo.items():
            if block is None:
                self.blocks.pop(engine_hash, None)
            else:
                self.blocks[engine_hash] = block
        for ref, count in changes._extra_undo.items():
            if count:
                self.extra[ref] = count
            else:
                self.extra.pop(ref, None)
        self.counts = changes._counts_undo

    def clear(self) -> None:
        """Forget every block (a reset); the caller hides and drops the stored copy."""
        self.blocks, self.masks, self.extra = {}, {}, {}
        self.counts = dict.fromkeys(TIER_BITS, 0)

    # ------------------------------------------------------------------- events

    def _store(
        self,
        event: StoreBlocks,
        block_size: int,
        result: ApplyResult,
        changes: BatchChanges,
        max_keys: int | None,
    ) -> None:
        hashes = event.hashes
        count = len(hashes)
        if not count:
            return
        per_block, rest = divmod(event.block_size, block_size)
        if per_block <= 0 or rest or len(event.token_ids) != count * event.block_size:
            result.partial += count
            return
        root: BlockKey | None
        if event.parent is None:
            parent, root = event.namespace, None
        else:
            parent_block = self.blocks.get(event.parent)
            if parent_block is None:
                result.orphans += count
                return
            parent, root = parent_block.keys[-1], parent_block.root
        try:
            data = token_bytes(event.token_ids)
        except (ValueError, TypeError):  # ids outside u32: the wire should have refused them
            result.invalid += count
            return
        keys = chain_keys(parent, data, block_size)
        bit = int(event.tier)
        stride = event.block_size * 4
        for j, engine_hash in enumerate(hashes):
            start = j * per_block
            known = self.blocks.get(engine_hash)
            if known is not None:
                if known.keys[-1] != keys[start + per_block - 1] and j + 1 < count:
                    # Stored earlier under another chain: children follow the stored keys.
                    keys[start + per_block :] = chain_keys(
                        known.keys[-1], data[(j + 1) * stride :], block_size
                    )
                root = known.root
                if not known.tiers & bit:
                    self._add(known.keys, known.root, bit, changes)
                    self._set_block(engine_hash, known._replace(tiers=known.tiers | bit), changes)
                result.stored += 1
                continue
            block_keys = tuple(keys[start : start + per_block])
            if root is None:
                root = block_keys[0]
            if max_keys is not None:
                masks = self.masks
                new = sum(1 for key in block_keys if key not in masks)
                if new and len(masks) + new > max_keys:
                    result.over_capacity += count - j
                    return
            self._add(block_keys, root, bit, changes)
            self._set_block(engine_hash, EngineBlock(block_keys, root, bit), changes)
            result.stored += 1

    def _remove(self, event: RemoveBlocks, result: ApplyResult, changes: BatchChanges) -> None:
        bit = int(event.tier)
        for engine_hash in event.hashes:
            block = self.blocks.get(engine_hash)
            if block is None or not block.tiers & bit:
                continue
            self._drop(block.keys, block.root, bit, changes)
            tiers = block.tiers & ~bit
            self._set_block(engine_hash, block._replace(tiers=tiers) if tiers else None, changes)
            result.removed += 1

    def _clear(self, changes: BatchChanges) -> None:
        changes.stale.update(self.masks)
        changes.stale.update(changes.keys)
        if changes._snapshot is None:
            changes._snapshot = (self.blocks, self.masks, self.extra)
        self.clear()
        changes.cleared = True
        changes.keys = {}
        changes.blocks = set()

    # ---------------------------------------------------------------- mutations

    def _add(
        self, keys: tuple[BlockKey, ...], root: BlockKey, bit: int, changes: BatchChanges
    ) -> None:
        masks = self.masks
        for key in keys:
            mask = masks.get(key, 0)
            if mask & bit:
                ref = (key, bit)
                self._set_extra(ref, self.extra.get(ref, 0) + 1, changes)
            else:
                self._set_mask(key, mask, mask | bit, root, changes)

    def _drop(
        self, keys: tuple[BlockKey, ...], root: BlockKey, bit: int, changes: BatchChanges
    ) -> None:
        masks = self.masks
        for key in keys:
            ref = (key, bit)
            others = self.extra.get(ref, 0)
            if others:
                self._set_extra(ref, others - 1, changes)
            else:
                mask = masks.get(key, 0)
                self._set_mask(key, mask, mask & ~bit, root, changes)

    def _set_mask(
        self, key: BlockKey, old: int, new: int, root: BlockKey, changes: BatchChanges
    ) -> None:
        if changes._snapshot is None and key not in changes._mask_undo:
            changes._mask_undo[key] = old
        if new:
            self.masks[key] = new
        else:
            self.masks.pop(key, None)
        flipped = old ^ new
        for bit in TIER_BITS:
            if flipped & bit:
                self.counts[bit] += 1 if new & bit else -1
        changes.keys[key] = root

    def _set_block(
        self, engine_hash: EngineHash, block: EngineBlock | None, changes: BatchChanges
    ) -> None:
        if changes._snapshot is None and engine_hash not in changes._block_undo:
            changes._block_undo[engine_hash] = self.blocks.get(engine_hash)
        if block is None:
            del self.blocks[engine_hash]
        else:
            self.blocks[engine_hash] = block
        changes.blocks.add(engine_hash)

    def _set_extra(self, ref: tuple[BlockKey, int], count: int, changes: BatchChanges) -> None:
        if changes._snapshot is None and ref not in changes._extra_undo:
            changes._extra_undo[ref] = self.extra.get(ref, 0)
        if count:
            self.extra[ref] = count
        else:
            del self.extra[ref]
