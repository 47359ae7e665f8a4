"""One source's writer: its batches, in seq order, into the index.

Each (pod, DP rank) has exactly one worker, so a source's batches are applied by one
writer in order, and a slow or failing source never holds up the others. Its bounded
queue, and the waiting on what it applied, are `inbox.SourceInbox`'s.

Batches arrive translated (`border.Received`); this writer only orders and applies them,
and asks the engine's replay buffer for what it missed: a gap, a join (the first batch
seen is not seq 0), or at once when it starts following a source (`catch_up`: what the
engine published before anyone listened, which an idle engine would never reveal).

What a write does when the index fails (held while it is down, the source rebuilt when
the index lost it, dropped when another indexer holds the lease) is decided in `writes`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from globalkv.index.base import ApplyResult, Index, IndexEvent, Source, SourceBatch
from globalkv.ingest.border import Received
from globalkv.ingest.inbox import SourceInbox
from globalkv.ingest.replay import ReplayClient, ReplayResult
from globalkv.ingest.sequencer import Step, classify, contiguous_tail
from globalkv.ingest.writes import INDEX_BACKOFF, Resyncs, SourceWrites
from globalkv.metrics import IngestMetrics
from globalkv.wire import WireError
from kvplumbing.backoff import Backoff
from kvplumbing.clock import WallClock

log = logging.getLogger(__name__)

_EVERY_SEQ = 1 << 64
"""Past any seq (an unsigned 64-bit counter): a catch-up asks for all the buffer holds."""


class SourceWorker(SourceInbox):
    def __init__(
        self,
        source: Source,
        model: str,
        replay_endpoint: str | None,
        *,
        index: Index,
        replayer: ReplayClient,
        metrics: IngestMetrics,
        resyncs: Resyncs,
        fenced: Callable[[Source], None],
        queue_size: int = 1024,
        max_queued_events: int = 1 << 16,
        max_group: int = 64,
        backoff: Backoff | None = None,
        expected: int | None = None,
        state_known: bool = True,
        wall_clock: WallClock = time.time,
    ) -> None:
        super().__init__(source, metrics, queue_size, max_queued_events, expected)
        self.model = model
        self.replay_endpoint = replay_endpoint
        self.replayer = replayer
        self.resyncs = resyncs
        self._writes = SourceWrites(
            source,
            index,
            resyncs=resyncs,
            metrics=metrics,
            fenced=fenced,
            backoff=backoff or INDEX_BACKOFF,
            held=self._changed,  # waiters may wait for the hold
        )
        self.max_group = max_group
        self.expected = expected
        """Next seq to apply; None until the source has state (from the index or live)."""
        self.state_known = state_known
        """False when the index could not tell what it holds for this source (it was
        unreachable when we started): a first batch then cannot assume an empty source."""
        self.wall_clock = wall_clock
        self._resync_requested = False
        self._catch_up_requested = False
        self._catch_up_from_start = False
        self.incomplete = False
        """Batches before some applied one were never applied (a replay could not give
        them): the index may lack blocks the engine holds, never hold extra ones."""
        self._replayed: tuple[int, float] | None = None
        """After a catch-up: the seq past its last batch and that batch's timestamp. A live
        batch below that seq published no later is a copy of one it applied, not a
        restart (the publisher sent it live before it answered the replay)."""
        self._pending: Received | None = None
        """Taken from the queue while grouping but not next in seq: handled next."""
        pod = source.pod
        self._m_batches = metrics.batches.labels(pod)
        self._m_stored = metrics.blocks_stored.labels(pod)
        self._m_removed = metrics.blocks_removed.labels(pod)

    # ---------------------------------------------------------------- requests

    def request_resync(self) -> None:
        self._resync_requested = True
        self.wake()

    def catch_up(self, *, from_start: bool = False) -> None:
        """Before the batches queued after this call, replay what the engine's buffer holds
        past the last batch applied: what it published before this indexer listened.

        Without it those batches are asked for only when a later one arrives (a join or a
        gap), and an engine that stores nothing more never sends one: its blocks stay
        out of the index. `from_start`: replay from seq 0 instead, over what is applied
        (the source was `incomplete` under a previous worker: a pod first seen on the
        bound socket joins without a replay endpoint, then registers one). Nothing to do
        without a replay endpoint.
        """
        if self.replay_endpoint is None:
            return
        self._catch_up_requested = True
        self._catch_up_from_start = from_start
        self.wake()

    # ---------------------------------------------------------------- the loop

    async def run(self) -> None:
        while True:
            item: Received | None = self._pending
            if item is not None:
                self._pending = None
            else:
                item = await self.queue.get()
                self._took(item)
            try:
                if self._resync_requested:
                    await self._resync(self.expected)
                if self._catch_up_requested:
                    await self._catch_up()
                if item is not None:
                    await self._handle(item)
            except asyncio.CancelledError:
                raise
            except Exception:
                # A bug must not silently stop this source for good: log it loudly, count
                # it, keep the loop; the next seq will look like a gap and be repaired.
                log.exception("ingest of %s failed on one batch", self.source)
                self._drop("internal_error")
            finally:
                self.queue.task_done()
                self._m_depth.set(self.queue.qsize())

    async def _handle(self, item: Received) -> None:
        if self._replayed is not None:
            stop, last_ts = self._replayed
            if item.seq >= stop:
                self._replayed = None
            elif isinstance(item.batch, WireError) or item.batch.ts <= last_ts:
                return  # applied already, from the catch-up's replay
        step = classify(self.expected, item.seq)
        if step is Step.GAP:
            assert self.expected is not None
            self.metrics.gaps.labels(self.source.pod).inc()
            log.info("%s: gap, expected seq %d got %d", self.source, self.expected, item.seq)
            await self._recover(self.expected, item.seq, reset_reason="gap")
        elif step is Step.JOIN:
            await self._recover(0, item.seq, reset_reason=None if self.state_known else "unknown")
        elif step is Step.RESTART:
            log.info("%s: seq went back to %d, engine restarted", self.source, item.seq)
            await self._reset("restart")
            if item.seq > 0:
                await self._recover(0, item.seq, reset_reason=None)
        else:
            await self._apply_group(self._group(item))
            return
        await self._apply_group([item])

    def _group(self, first: Received) -> list[Received]:
        """`first` and the batches queued right behind it that follow it in seq order.

        Applied as one index batch (group commit): under load the index sees a few large
        atomic writes instead of many small round trips; when idle, a batch goes alone
        and nothing waits. Effects are those of applying the batches one by one.
        """
        group = [first]
        while len(group) < self.max_group and not self.queue.empty():
            item = self.queue.get_nowait()
            self._took(item)
            if item is None:
                self.queue.task_done()
                continue
            if item.seq != group[-1].seq + 1:
                self._pending = item
                break
            # Done for join() already: the first item's task_done waits for the group.
            self.queue.task_done()
            group.append(item)
        return group

    async def _recover(self, start: int, stop: int, *, reset_reason: str | None) -> None:
        """Replay [start, stop); reset first if the range cannot be filled and must be."""
        if self.replay_endpoint is None:
            await self._settle(start, stop, ReplayResult(outcome="no_endpoint"), reset_reason)
            return
        result = await self.replayer.fetch(self.replay_endpoint, start, stop, self.model)
        await self._settle(start, stop, result, reset_reason)

    async def _catch_up(self) -> None:
        """Replay everything buffered from the next seq this source needs (`catch_up`)."""
        self._catch_up_requested = False
        if self.replay_endpoint is None:
            return
        start = 0 if self._catch_up_from_start else self.expected or 0
        result = await self.replayer.fetch(self.replay_endpoint, start, _EVERY_SEQ, self.model)
        ended = result.outcome == "end"
        if not result.batches:  # nothing missed (not counted as a replay), or no answer
            if not ended:
                self.metrics.replays.labels(self.source.pod, result.outcome).inc()
            return
        last = max(result.batches, key=lambda b: b.seq)
        reason: str | None = None  # from 0, in order, over a subset: nothing left stale
        if self.expected is not None and not self._catch_up_from_start:
            reason = "gap"  # what the buffer lacks may have removed blocks
        elif self.expected is None and not self.state_known:
            reason = "unknown"
        await self._settle(start, last.seq + 1, result, reason, whole=ended)
        if not isinstance(last.batch, WireError):
            self._replayed = (last.seq + 1, last.batch.ts)

    async def _settle(
        self,
        start: int,
        stop: int,
        result: ReplayResult,
        reset_reason: str | None,
        *,
        whole: bool = True,
    ) -> None:
        """Apply what a replay got of [start, stop): all of it, or after a reset (when
        `reset_reason` says one is needed) the run of it that ends at `stop - 1`.
        `whole`: false when the replay stopped before the publisher's end (a catch-up
        counts it by why it stopped, even with its range filled)."""
        pod = self.source.pod
        replayed, complete = contiguous_tail(result.batches, start, stop)
        if result.outcome == "no_endpoint":
            complete, outcome = False, "no_endpoint"
        elif complete:
            outcome = "complete" if whole else result.outcome
        else:
            outcome = "short" if result.outcome == "end" else result.outcome
        self.metrics.replays.labels(pod, outcome).inc()
        if start == 0 or not complete:
            self.incomplete = not complete
        if not complete and reset_reason is not None:
            log.warning(
                "%s: replay of [%d, %d) %s; resetting the source", self.source, start, stop, outcome
            )
            await self._reset(reset_reason)
        self.metrics.replayed_batches.labels(pod).inc(len(replayed))
        for start_at in range(0, len(replayed), self.max_group):
            await self._apply_group(replayed[start_at : start_at + self.max_group])

    async def _resync(self, stop: int | None) -> None:
        """Rebuild the source after the index lost its data: batches [0, stop)."""
        self._resync_requested = False
        try:
            if stop:
                await self._recover(0, stop, reset_reason="data_lost")
        finally:
            self.resyncs.resynced(self.source)

    async def _reset(self, reason: str) -> None:
        self.metrics.resets.labels(self.source.pod, reason).inc()
        self.state.resets += 1
        await self._writes.reset()

    # ---------------------------------------------------------------- applying

    async def _apply_group(self, group: Sequence[Received]) -> None:
        """Consecutive batches of this source applied as one.

        A malformed batch is dropped but its seq still counts as handled (it is not a gap).
        """
        events: list[IndexEvent] = []
        last_ts: float | None = None
        arrivals: list[float] = []
        for item in group:
            batch = item.batch
            if isinstance(batch, WireError):
                log.warning("%s: dropping malformed batch %d: %s", self.source, item.seq, batch)
                self._drop(batch.reason)
                continue
            events.extend(batch.events)
            last_ts = batch.ts
            arrivals.append(item.at)
        last_seq = group[-1].seq
        if last_ts is not None:
            batch_out = SourceBatch(self.source, last_seq, last_ts, events)
            result = await self._writes.apply(batch_out)
            while result is None:  # the index lost the source: rebuilt before the group, then again
                await self._resync(group[0].seq)
                result = await self._writes.apply(batch_out)
            self._count(result)
            now = time.monotonic()
            for at in arrivals:
                self.metrics.lag.observe(now - at)
            self._m_batches.inc(len(arrivals))
        self._advance(last_seq, last_ts, len(arrivals))

    def _count(self, result: ApplyResult) -> None:
        if result.stored:
            self._m_stored.inc(result.stored)
        if result.removed:
            self._m_removed.inc(result.removed)

    def _advance(self, seq: int, ts: float | None, batches: int) -> None:
        self.expected = seq + 1
        self.state_known = True
        state = self.state
        state.last_seq = seq
        state.applied += batches
        state.last_applied_at = self.wall_clock()
        if ts is not None:
            state.last_event_ts = ts
        self._changed()
