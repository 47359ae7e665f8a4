"""The queue side of a source's worker (`worker.SourceWorker`): what feeds it, and who
waits on what it applied.

The queue is bounded twice, in batches and in the events they hold (a batch of a
hundred thousand events is one item): a subscriber connected to one engine awaits room
(`put`: back-pressure reaches the SUB socket, whose high-water mark makes the engine's PUB
drop, which is later seen as a gap and replayed); the shared bound socket cannot wait for
one source, so it drops the batch (`offer`: `queue_full`), which becomes a gap the same
way. Waiters (`wait`, `applied`, `idle`) are how callers and tests learn that a batch is
visible without sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from globalkv.index.base import Source
from globalkv.ingest.border import Received
from globalkv.metrics import IngestMetrics
from globalkv.registry import SourceProgress
from globalkv.wire import WireError

_WAKE = None
"""Queued to wake an idle worker for what it was asked to do (a resync, a catch-up)."""


class SourceInbox:
    def __init__(
        self,
        source: Source,
        metrics: IngestMetrics,
        queue_size: int,
        max_queued_events: int,
        expected: int | None,
    ) -> None:
        self.source = source
        self.metrics = metrics
        self.received = 0
        """Live batches handed to this worker, queued or dropped (a plain int: per message)."""
        self.queue: asyncio.Queue[Received | None] = asyncio.Queue(queue_size)
        self.max_queued_events = max_queued_events
        self.queued_events = 0
        """Events of the batches in the queue; past `max_queued_events` a batch waits or
        is dropped, unless the queue holds no events (a batch alone always fits)."""
        self._room = asyncio.Event()
        self.state = SourceProgress(dp_rank=source.dp_rank)
        self.state.last_seq = None if expected is None else expected - 1
        self._waiters: list[tuple[Callable[[SourceProgress], bool], asyncio.Future[None]]] = []
        self._stopped = asyncio.Event()
        """Set when its pod stops being followed: its queue is abandoned, not drained."""
        self._m_depth = metrics.queue_depth.labels(source.pod, str(source.dp_rank))

    async def put(self, item: Received) -> None:
        """Wait for room: back-pressure to the caller's socket."""
        self.received += 1
        size = _events(item)
        while not self._fits(size):
            self._room.clear()
            await self._room.wait()
        await self.queue.put(item)
        self.queued_events += size
        self._m_depth.set(self.queue.qsize())
        if self._waiters:
            self._changed()

    def offer(self, item: Received) -> bool:
        """Queue without waiting; a full queue drops the batch (seen later as a gap)."""
        self.received += 1
        size = _events(item)
        try:
            if not self._fits(size):
                raise asyncio.QueueFull
            self.queue.put_nowait(item)
        except asyncio.QueueFull:
            self._drop("queue_full")
            return False
        self.queued_events += size
        self._m_depth.set(self.queue.qsize())
        if self._waiters:
            self._changed()
        return True

    def _fits(self, size: int) -> bool:
        return not self.queued_events or self.queued_events + size <= self.max_queued_events

    def _took(self, item: Received | None) -> None:
        """`item` left the queue: its events no longer count against the bound."""
        if item is not None:
            self.queued_events -= _events(item)
            self._room.set()

    async def applied(self, seq: int) -> None:
        """Return once batch `seq` (or a later one) of this source is visible in the index."""
        await self.wait(lambda state: state.last_seq is not None and state.last_seq >= seq)

    async def wait(self, condition: Callable[[SourceProgress], bool]) -> None:
        """Return once `condition` holds for the source's state, checked now (its queue
        depth read afresh: puts refresh it only for waiters) and after each batch."""
        self.state.queue_depth = self.queue.qsize()
        if condition(self.state):
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((condition, future))
        try:
            await future
        finally:
            self._waiters = [(c, f) for c, f in self._waiters if f is not future]

    async def idle(self) -> None:
        """Return once everything queued so far has been handled, or the worker stopped
        (a pod removed or replaced while someone flushes must not hold them forever)."""
        if self._stopped.is_set():
            return
        drained = asyncio.ensure_future(self.queue.join())
        stopped = asyncio.ensure_future(self._stopped.wait())
        try:
            await asyncio.wait((drained, stopped), return_when=asyncio.FIRST_COMPLETED)
        finally:
            drained.cancel()
            stopped.cancel()

    def stopped(self) -> None:
        """Its loop was cancelled (the pod is no longer followed); what is queued is dropped."""
        self._stopped.set()

    def wake(self) -> None:
        """Wake the loop if idle (a busy one checks its requests before each item)."""
        with contextlib.suppress(asyncio.QueueFull):
            self.queue.put_nowait(_WAKE)

    def _changed(self) -> None:
        self.state.queue_depth = self.queue.qsize()
        for condition, future in self._waiters:
            if not future.done() and condition(self.state):
                future.set_result(None)

    def _drop(self, reason: str) -> None:
        self.metrics.dropped.labels(reason).inc()
        self.state.drops += 1
        self._changed()


def _events(item: Received) -> int:
    return 0 if isinstance(item.batch, WireError) else len(item.batch.events)
