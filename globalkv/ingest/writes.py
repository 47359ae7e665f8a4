"""A source's writes to the index, through the index's failures.

What each failure means for a write is decided here, once, for the batches a worker
applies and the resets it makes:

- `IndexUnavailable`: the write is held and tried again with capped exponential backoff,
  the worker's bounded queue filling behind it meanwhile; `recovery` is told the source is
  held (and why) until a write goes through, so `/health` says the index is behind.
- `IndexDataLost` (an unavailability that retrying cannot mend): `recovery` is told, and
  asks the worker of every source lost (all of them, unless the index names some) to
  rebuild it (replay from seq 0 where the engine's buffer still starts there, otherwise
  reset and apply what the buffer has). A batch of a source that was not lost is applied
  again; one whose own source was lost goes back to its worker, which rebuilds first.
- `IndexFenced` (another indexer holds the pod's lease now): the write is dropped, counted
  and `following` told, which stops following the pod: retrying could only be refused
  again.

It is apart from the worker (`worker.SourceWorker`), which decides what to write and in
which order; this decides how a write survives the index.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Protocol, TypeVar

from globalkv.index.base import (
    ApplyResult,
    Index,
    IndexDataLost,
    IndexFenced,
    IndexUnavailable,
    Source,
    SourceBatch,
)
from globalkv.metrics import IngestMetrics
from kvplumbing.backoff import Backoff

log = logging.getLogger(__name__)

T = TypeVar("T")

INDEX_BACKOFF = Backoff(base=0.05, cap=2.0)
"""Waits while the index is unreachable: 50 ms doubling to 2 s (`IngestConfig.retry_*`)."""


class Resyncs(Protocol):
    """Who rebuilds what the index lost (`recovery.Recovery`)."""

    def data_lost(self, source: Source, lost: frozenset[Source] | None) -> None:
        """The index lost the data of `lost` (None: of every source): rebuild them."""
        ...

    def resynced(self, source: Source) -> None: ...

    def holding(self, source: Source, reason: str) -> None:
        """The index refused `source`'s write for now: it is held and retried."""
        ...

    def released(self, source: Source) -> None:
        """The index took `source`'s write after refusing it."""
        ...


class SourceWrites:
    """One source's writes: `apply` a batch, `reset` the source."""

    def __init__(
        self,
        source: Source,
        index: Index,
        *,
        resyncs: Resyncs,
        metrics: IngestMetrics,
        fenced: Callable[[Source], None],
        backoff: Backoff,
        held: Callable[[], None],
    ) -> None:
        self._source = source
        self._index = index
        self._resyncs = resyncs
        self._metrics = metrics
        self._fenced = fenced
        """Called when a write was refused: another indexer holds the pod's lease."""
        self._backoff = backoff
        self._held = held
        """Called when a write is held, for whoever waits on the source to see it."""

    async def apply(self, batch: SourceBatch) -> ApplyResult | None:
        """What applying `batch` did (nothing when fenced); None when the index lost this
        source's data: the caller rebuilds the source, then applies the batch again."""
        while True:
            try:
                return await self._while_index_unavailable(partial(self._index.apply, batch))
            except IndexFenced:
                self._refused()
                return ApplyResult()
            except IndexDataLost as exc:
                self._metrics.data_lost.inc()
                self._resyncs.data_lost(self._source, exc.sources)
                if exc.sources is not None and self._source not in exc.sources:
                    log.warning("%s: the index lost other sources' data: %s", self._source, exc)
                    continue  # this batch was not applied: again, as it was
                log.warning("%s: the index lost its data; resyncing", self._source)
                return None

    async def reset(self) -> None:
        """Hide and drop everything the index holds of the source."""
        try:
            await self._while_index_unavailable(partial(self._index.reset_source, self._source))
        except IndexDataLost:  # nothing of the source is left to hide
            pass
        except IndexFenced:
            self._refused()

    async def _while_index_unavailable(self, call: Callable[[], Awaitable[T]]) -> T:
        """`call()`'s result, tried again after the backoff while the index is down;
        `IndexDataLost` (an `IndexUnavailable` that retrying cannot mend) goes to the caller."""
        attempt = 0
        while True:
            try:
                done = await call()
            except IndexDataLost:
                raise
            except IndexUnavailable as exc:
                delay = self._backoff.delay(attempt)
                attempt += 1
                self._resyncs.holding(self._source, str(exc))
                self._held()
                self._metrics.index_unavailable.inc()
                log.warning(
                    "%s: index unavailable (%s); retrying in %.2fs", self._source, exc, delay
                )
                await asyncio.sleep(delay)
            else:
                self._resyncs.released(self._source)  # also after a data loss ended a hold
                return done

    def _refused(self) -> None:
        self._metrics.fenced.labels(self._source.pod).inc()
        self._fenced(self._source)
