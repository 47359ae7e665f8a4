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

Every map is int -> int, and an engine block is one int (`packing.py` says why).

A batch is atomic: `apply` records enough to `rollback` an exception half-way, and
reports what changed (`batch_changes.BatchChanges`) for the backend to store.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from globalkv.index.base import (
    ApplyResult,
    ClearSource,
    IndexEvent,
    RemoveBlocks,
    StoreBlocks,
)
from globalkv.index.batch_changes import BatchChanges
from globalkv.index.packing import (
    DEPTH_AT,
    DEPTH_BITS,
    KEY_MASK,
    LAST_AT,
    ROOT_AT,
    TIER_BITS,
    EngineBlock,
    block_keys,
    first_place,
    next_depth,
    pack_block,
    place,
    unpack_block,
)
from globalkv.keys import BlockKey, EngineHash, chain_keys, token_bytes


class SourceState:
    """One source's blocks; the same for the memory index and a Redis writer's cache."""

    __slots__ = ("blocks", "counts", "epoch", "extra", "last_seq", "last_ts", "masks", "resets")

    def __init__(self, epoch: int = 0, resets: int = 0) -> None:
        self.blocks: dict[EngineHash, int] = {}
        """Engine hash -> the block, packed by `pack_block`."""
        self.masks: dict[BlockKey, int] = {}
        """Key -> tiers this source holds it in (the union over its engine blocks)."""
        self.extra: dict[int, int] = {}
        """key << 3 | tier bit -> engine blocks beyond the first holding the key there."""
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
        for engine_hash, block in blocks:
            for bit in TIER_BITS:
                if block.tiers & bit:
                    at = place(block.root, block.depth)
                    state.counts[bit] += state._hold(block.keys, at, bit, changes)
            state.blocks[engine_hash] = pack_block(block)
        return state

    def engine_block(self, engine_hash: EngineHash) -> EngineBlock | None:
        word = self.blocks.get(engine_hash)
        return None if word is None else unpack_block(word)

    def engine_blocks(self) -> Iterator[tuple[EngineHash, EngineBlock]]:
        for engine_hash, word in self.blocks.items():
            yield engine_hash, unpack_block(word)

    # ------------------------------------------------------------------ batches

    def apply(
        self,
        events: Sequence[IndexEvent],
        block_size: int,
        result: ApplyResult,
        max_keys: int | None = None,
    ) -> BatchChanges:
        """Apply a batch's events in order; the state is unchanged if this raises.

        `max_keys` bounds how many keys, and engine blocks (several may name one key), the
        source may hold when the batch ends a store; stores beyond are skipped and counted
        as over capacity."""
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
        self.blocks, self.masks, self.extra = changes.undo(self.blocks, self.masks, self.extra)
        self.counts = changes.counts_before

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
        start = self._chain_start(event, block_size, result)
        if start is None:
            return
        data, keys, root, depth = start
        hashes = event.hashes
        count = len(hashes)
        per_block = event.block_size // block_size
        blocks = self.blocks
        bit = int(event.tier)
        # The loop every stored block takes: local names, no call per block for the usual
        # engine block of one index block that the source did not hold.
        masks = self.masks
        held = masks.get
        known_block = blocks.get
        block_before = changes.blocks.setdefault
        mask_before = changes.masks_before.setdefault
        changed = changes.keys
        high = 0 if root is None else bit | root << ROOT_AT
        added = stored = 0
        for j, engine_hash in enumerate(hashes):
            word = known_block(engine_hash)
            if word is not None:
                last = word >> LAST_AT & KEY_MASK
                if last != keys[(j + 1) * per_block - 1] and j + 1 < count:
                    # Stored earlier under another chain: children follow the stored keys.
                    stride = event.block_size * 4
                    keys[(j + 1) * per_block :] = chain_keys(
                        BlockKey(last), data[(j + 1) * stride :], block_size
                    )
                root = word >> ROOT_AT & KEY_MASK
                high = bit | root << ROOT_AT
                depth = next_depth(word)
                if not word & bit:
                    held_keys = block_keys(word)
                    at = first_place(word, len(held_keys))
                    added += self._hold(held_keys, at, bit, changes)
                    block_before(engine_hash, word)
                    blocks[engine_hash] = word | bit
                stored += 1
                continue
            if per_block == 1:
                key = keys[j]
                if root is None:
                    root = key
                    high = bit | key << ROOT_AT
                mask = held(key, 0)
                if max_keys is not None and max(len(blocks), 0 if mask else len(masks)) >= max_keys:
                    result.over_capacity += count - j
                    break
                if mask & bit:
                    self._set_extra(key << 3 | bit, 1, changes)
                else:
                    mask_before(key, mask)
                    masks[key] = mask | bit
                    changed[key] = root << DEPTH_BITS | depth
                    added += 1
                block_before(engine_hash, None)
                blocks[engine_hash] = high | depth << DEPTH_AT | key << LAST_AT
                depth += 1
            else:
                new = tuple(keys[j * per_block : (j + 1) * per_block])
                if root is None:
                    root = new[0]
                    high = bit | root << ROOT_AT
                held_new = self._store_wide(engine_hash, new, root, depth, bit, changes, max_keys)
                if held_new is None:
                    result.over_capacity += count - j
                    break
                added += held_new
                depth += per_block
            stored += 1
        self.counts[bit] += added
        result.stored += stored

    def _chain_start(
        self, event: StoreBlocks, block_size: int, result: ApplyResult
    ) -> tuple[bytes, list[BlockKey], int | None, int] | None:
        """The store's tokens as bytes, its chain keys, and the root and depth it continues
        from; None (counted in `result`) when the store cannot be keyed."""
        count = len(event.hashes)
        if not count:
            return None
        per_block, rest = divmod(event.block_size, block_size)
        if per_block <= 0 or rest or len(event.token_ids) != count * event.block_size:
            result.partial += count
            return None
        parent: int
        root: int | None
        if event.parent is None:
            parent, root, depth = event.namespace, None, 0
        else:
            parent_word = self.blocks.get(event.parent)
            if parent_word is None:
                result.orphans += count
                return None
            parent, root = parent_word >> LAST_AT & KEY_MASK, parent_word >> ROOT_AT & KEY_MASK
            depth = next_depth(parent_word)
        try:
            data = token_bytes(event.token_ids)
        except (ValueError, TypeError):  # ids outside u32: the wire should have refused them
            result.invalid += count
            return None
        return data, chain_keys(BlockKey(parent), data, block_size), root, depth

    def _store_wide(
        self,
        engine_hash: EngineHash,
        new: tuple[BlockKey, ...],
        root: int,
        depth: int,
        bit: int,
        changes: BatchChanges,
        max_keys: int | None,
    ) -> int | None:
        """An engine block of several index blocks the source did not hold: the number of
        keys it newly holds, or None when they would pass `max_keys` (nothing stored)."""
        if max_keys is not None:
            fresh = sum(1 for key in new if key not in self.masks)
            if (fresh and len(self.masks) + fresh > max_keys) or len(self.blocks) >= max_keys:
                return None
        added = self._hold(new, place(root, depth), bit, changes)
        changes.blocks.setdefault(engine_hash, None)
        self.blocks[engine_hash] = pack_block(EngineBlock(new, BlockKey(root), bit, depth))
        return added

    def _remove(self, event: RemoveBlocks, result: ApplyResult, changes: BatchChanges) -> None:
        bit = int(event.tier)
        blocks = self.blocks
        released = 0
        for engine_hash in event.hashes:
            word = blocks.get(engine_hash)
            if word is None or not word & bit:
                continue
            held_keys = block_keys(word)
            released += self._release(held_keys, first_place(word, len(held_keys)), bit, changes)
            changes.blocks.setdefault(engine_hash, word)
            if word & 7 == bit:
                del blocks[engine_hash]
            else:
                blocks[engine_hash] = word ^ bit
            result.removed += 1
        self.counts[bit] -= released

    def _clear(self, changes: BatchChanges) -> None:
        changes.clearing(self.blocks, self.masks, self.extra)
        self.clear()

    # ---------------------------------------------------------------- mutations

    def _hold(self, keys: Iterable[BlockKey], at: int, bit: int, changes: BatchChanges) -> int:
        """One more engine block holds `keys` (the first at place `at`) in tier `bit`;
        returns the keys newly held."""
        masks = self.masks
        added = 0
        for i, key in enumerate(keys):
            mask = masks.get(key, 0)
            if mask & bit:
                self._set_extra(key << 3 | bit, 1, changes)
            else:
                changes.masks_before.setdefault(key, mask)
                masks[key] = mask | bit
                changes.keys[key] = at + i
                added += 1
        return added

    def _release(self, keys: Iterable[BlockKey], at: int, bit: int, changes: BatchChanges) -> int:
        """One engine block less holds `keys` (the first at place `at`) in tier `bit`;
        returns the keys no longer held."""
        masks, extra = self.masks, self.extra
        released = 0
        for i, key in enumerate(keys):
            if extra and extra.get(key << 3 | bit):
                self._set_extra(key << 3 | bit, -1, changes)
                continue
            mask = masks.get(key, 0)
            if not mask & bit:
                continue
            changes.masks_before.setdefault(key, mask)
            if mask == bit:
                del masks[key]
            else:
                masks[key] = mask ^ bit
            changes.keys[key] = at + i
            released += 1
        return released

    def _set_extra(self, ref: int, step: int, changes: BatchChanges) -> None:
        count = self.extra.get(ref, 0)
        changes.extra_before.setdefault(ref, count)
        if count + step:
            self.extra[ref] = count + step
        else:
            del self.extra[ref]
