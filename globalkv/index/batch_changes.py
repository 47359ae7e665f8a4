"""What one batch changed in a source's state (`state.SourceState`): the record a backend
stores from, and the undo that makes the batch atomic.

It is apart from the state because it is what passes between the two halves of a write:
the state computes the changes once, and each backend (`memory`, `redis_batch`) reads them
to store its own copy; a batch that raises half-way is undone from the same record.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from globalkv.keys import BlockKey, EngineHash

_T = TypeVar("_T")


class BatchChanges:
    """What a batch changed, for the backend to store; also the batch's undo record.

    The `*_before` maps and `blocks` hold the first value each entry had since the batch
    began or, after a clear, since the clear; a clear keeps the maps it replaced, with
    their undo, in `_before`.
    """

    __slots__ = (
        "_before",
        "blocks",
        "cleared",
        "counts_before",
        "extra_before",
        "keys",
        "masks_before",
        "stale",
    )

    def __init__(self, counts: dict[int, int]) -> None:
        self.cleared = False
        """The source was cleared first; `keys` and `blocks` are relative to empty."""
        self.keys: dict[BlockKey, int] = {}
        """Keys whose mask may differ (since the last clear), with their `place` (chain
        root and position): where Redis stores them."""
        self.masks_before: dict[BlockKey, int] = {}
        self.blocks: dict[EngineHash, int | None] = {}
        """Engine blocks added, changed or dropped (since the last clear), packed as before."""
        self.extra_before: dict[int, int] = {}
        self.stale: set[BlockKey] = set()
        """Keys held or touched before a clear of this batch (to un-index in memory)."""
        self.counts_before = dict(counts)
        """Tier bit -> keys held, as when the batch began."""
        self._before: (
            tuple[
                dict[EngineHash, int],
                dict[BlockKey, int],
                dict[int, int],
                dict[EngineHash, int | None],
                dict[BlockKey, int],
                dict[int, int],
            ]
            | None
        ) = None

    def stored_mask(self, key: BlockKey) -> int:
        """A changed key's mask before the batch, as the backend still stores it."""
        return 0 if self.cleared else self.masks_before[key]

    def clearing(
        self, blocks: dict[EngineHash, int], masks: dict[BlockKey, int], extra: dict[int, int]
    ) -> None:
        """The source's maps, `blocks`, `masks` and `extra`, are about to be replaced by
        empty ones: what they held is stale, and they are kept to undo the batch (with the
        undo recorded until then, the first clear's only: later ones replaced maps the batch
        itself built)."""
        self.stale.update(masks)
        self.stale.update(self.keys)
        if self._before is None:
            self._before = (blocks, masks, extra, self.blocks, self.masks_before, self.extra_before)
        self.cleared = True
        self.keys = {}
        self.blocks = {}
        self.masks_before = {}
        self.extra_before = {}

    def undo(
        self, blocks: dict[EngineHash, int], masks: dict[BlockKey, int], extra: dict[int, int]
    ) -> tuple[dict[EngineHash, int], dict[BlockKey, int], dict[int, int]]:
        """The source's maps as they were before the batch, from the maps it has now (or,
        after a clear, the maps the clear replaced)."""
        blocks_before, masks_before, extra_before = (
            self.blocks,
            self.masks_before,
            self.extra_before,
        )
        if self._before is not None:
            blocks, masks, extra, blocks_before, masks_before, extra_before = self._before
        _restore(blocks, blocks_before)
        _restore(masks, masks_before)
        _restore(extra, extra_before)
        return blocks, masks, extra


def _restore(table: dict[_T, int], before: Mapping[_T, int | None]) -> None:
    for entry, value in before.items():
        if value:
            table[entry] = value
        else:
            table.pop(entry, None)
