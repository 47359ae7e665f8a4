"""An index that records what ingest did to it, and fails on command."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from globalkv.index.base import (
    ApplyResult,
    Hit,
    IndexDataLost,
    IndexUnavailable,
    RemoveBlocks,
    Source,
    SourceBatch,
    SourceStats,
    StoreBlocks,
)
from globalkv.keys import BlockKey


@dataclass
class RecordingIndex:
    block_size: int = 4
    applied: dict[Source, list[int]] = field(default_factory=dict)
    """Seqs applied per source, in order; a reset appends -1."""
    batches: list[SourceBatch] = field(default_factory=list)
    removed_pods: list[str] = field(default_factory=list)
    unavailable: int = 0
    """The next this-many calls raise IndexUnavailable."""
    lose_data: bool = False
    """The next apply raises IndexDataLost (once) and the recorded state is wiped."""
    lose_only: frozenset[Source] | None = None
    """With `lose_data`: only these sources' state is wiped, and the error names them."""
    gate: asyncio.Event | None = None
    """When set, applies wait for it: a slow index."""
    at_gate: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once an apply waits at the gate: its batch has left the worker's queue."""

    def _check(self) -> None:
        if self.unavailable:
            self.unavailable -= 1
            raise IndexUnavailable("told to be down")

    async def apply(self, batch: SourceBatch) -> ApplyResult:
        if self.gate is not None:
            self.at_gate.set()
            await self.gate.wait()
        self._check()
        if self.lose_data:
            self.lose_data = False
            for source in list(self.applied):
                if self.lose_only is None or source in self.lose_only:
                    del self.applied[source]
            raise IndexDataLost("told to lose data", self.lose_only)
        self.applied.setdefault(batch.source, []).append(batch.seq)
        self.batches.append(batch)
        result = ApplyResult()
        for event in batch.events:
            if isinstance(event, StoreBlocks):
                result.stored += len(event.hashes)
            elif isinstance(event, RemoveBlocks):
                result.removed += len(event.hashes)
        return result

    async def lookup(self, keys: Sequence[BlockKey]) -> list[Hit]:
        self._check()
        return []

    async def reset_source(self, source: Source) -> None:
        self._check()
        self.applied.setdefault(source, []).append(-1)

    async def remove_pod(self, pod: str) -> None:
        self._check()
        self.removed_pods.append(pod)
        for source in [s for s in self.applied if s.pod == pod]:
            del self.applied[source]

    async def stats(self, pod: str | None = None) -> list[SourceStats]:
        self._check()
        return [
            SourceStats(source=s, epoch=0, last_seq=max(seqs) if seqs else None)
            for s, seqs in self.applied.items()
            if pod is None or s.pod == pod
        ]

    async def close(self) -> None:
        return None
