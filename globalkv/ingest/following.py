"""Which pods this indexer follows: adding, replacing and removing them, and their sources.

Pods come and go through `add` / `remove` (called by the API, the CLI's `--pod` flags,
`podsync` and `ownership`, all idempotent), or appear by themselves on the bound socket
(`discovery`, whose sources `bound` starts here with `start_worker`). A connect-mode pod
gets one subscription and one worker per DP rank at once, each resuming where the index
says the source stopped (a previous indexer may have written it) and catching up at once
from the engine's replay buffer; so does each rank of a bind-mode pod registered with a
replay endpoint, before its first live batch. A removed pod's blocks
are cleared from the index; if the index cannot answer then, `clear_removed` (run by
podsync too) tries again, so they do not linger in lookups.

With several indexers on one Redis, the `PodGate` (`ownership.HeldLeases`) says which pods
this one may follow: `add` of another's pod records nothing. A fenced write (the pod's
lease is another's now) tells the gate and stops the pod here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol

import zmq.asyncio

from globalkv.index.base import Index, IndexUnavailable, Source
from globalkv.ingest.config import IngestConfig
from globalkv.ingest.discovery import Discovery
from globalkv.ingest.followed import FollowedPod, FollowedPods
from globalkv.ingest.publishers import pod_hosts, resolve
from globalkv.ingest.recovery import Recovery
from globalkv.ingest.replay import ReplayClient
from globalkv.ingest.subscribers import EngineSubscription, SubLimits, replay_endpoint
from globalkv.ingest.tasks import Background, watched
from globalkv.ingest.worker import SourceWorker
from globalkv.metrics import IngestMetrics
from globalkv.registry import PodInfo
from kvplumbing.backoff import Backoff
from kvplumbing.endpoints import offset_endpoint
from kvplumbing.tasks import cancel_and_wait

log = logging.getLogger(__name__)


class PodGate(Protocol):
    """Which pods this indexer may follow, and where a lost lease is reported."""

    def holds(self, pod: str) -> bool: ...

    def lost(self, pod: str) -> None:
        """A write of the pod was fenced: its lease is another indexer's already."""
        ...


class EveryPod:
    """The gate of a single indexer: every pod is its own, and no lease is lost."""

    def holds(self, pod: str) -> bool:
        return True

    def lost(self, pod: str) -> None:
        return None


class Following:
    def __init__(
        self,
        index: Index,
        pods: FollowedPods,
        *,
        config: IngestConfig,
        context: zmq.asyncio.Context,
        replayer: ReplayClient,
        recovery: Recovery,
        discovery: Discovery,
        gate: PodGate,
        metrics: IngestMetrics,
        background: Background,
    ) -> None:
        self._index = index
        self._pods = pods
        self._config = config
        self._context = context
        self._replayer = replayer
        self._recovery = recovery
        self._discovery = discovery
        self._gate = gate
        self._metrics = metrics
        self._background = background
        self._limits = SubLimits(config.rcvhwm, config.max_message_bytes)
        self._backoff = Backoff(config.retry_base, config.retry_cap)
        self._lock = asyncio.Lock()
        self._uncleared: set[str] = set()
        """Removed pods whose blocks the index could not drop yet."""
        self._fencing: set[str] = set()
        """Pods being stopped because a write of theirs was fenced."""

    def pods(self) -> list[PodInfo]:
        return [p.info for p in self._pods]

    def check(self, info: PodInfo) -> None:
        """Raise `followed.TopicTaken` or `config.EndpointRefused` if `add(info)` would:
        before writing it anywhere."""
        self._config.check_endpoints(info)
        self._pods.check(info)

    async def add(self, info: PodInfo) -> None:
        """Follow a pod (idempotent: a pod already followed with the same info is kept).

        Raises `followed.TopicTaken` when its bound topic names another followed pod, and
        `config.EndpointRefused` when an endpoint's scheme is not allowed.
        """
        if not self._gate.holds(info.id):
            return
        async with self._lock:
            current = self._pods.get(info.id)
            if current is not None and current.info == info:
                return
            self.check(info)
            hosts = pod_hosts(info) if info.kv_events.mode == "bind" else []
            home = await resolve(hosts) if hosts else None
            lacking: set[int] = set()
            if current is not None:
                lacking = {rank for rank, w in current.workers.items() if w.incomplete}
                await self._stop(info.id)
            self._uncleared.discard(info.id)
            pod = self._pods.add(info, home)
            if info.kv_events.mode == "connect":
                for rank in range(info.dp_size):
                    await self._subscribe(pod, rank, rank in lacking)
            elif not self._config.bind:
                log.warning("pod %s publishes to a bound SUB, and this indexer binds none", info.id)
            elif info.kv_events.replay_endpoint is not None:
                for rank in range(info.dp_size):
                    await self._catch_up(pod, rank, rank in lacking)
            self._refresh_subscribed()

    async def remove(self, pod_id: str, *, clear: bool = True, drain: float = 0.0) -> bool:
        """Stop following a pod; with `clear`, forget its blocks in the index too (when
        the index cannot answer, `IndexUnavailable` is raised and `clear_removed` retries).

        `drain`: first let its workers offer what they hold to the index, for at most this
        long (a pod whose lease was lost: the index refuses those writes, and counts them).
        """
        pod = self._pods.get(pod_id)
        if drain > 0 and pod is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(drain):
                    await asyncio.gather(*(w.idle() for w in pod.workers.values()))
        async with self._lock:
            existed = await self._stop(pod_id)
        if clear:
            self._uncleared.add(pod_id)
            await self._clear(pod_id)
        return existed

    async def clear_removed(self) -> None:
        """Drop the blocks of removed pods that the index could not drop at the time."""
        for pod_id in sorted(self._uncleared):
            await self._clear(pod_id)

    async def stop(self) -> None:
        """Stop following every pod (their blocks stay in the index)."""
        for pod in self._pods:
            await self._stop(pod.info.id)

    def start_worker(
        self, pod: FollowedPod, rank: int, expected: int | None = None, known: bool = True
    ) -> SourceWorker:
        """The writer of DP rank `rank` of `pod`, running; `expected` and `known`: where
        the index says the source stopped, and whether it could say."""
        source = Source(pod.info.id, rank)
        worker = SourceWorker(
            source,
            pod.info.model,
            replay_endpoint(pod.info, rank),
            index=self._index,
            replayer=self._replayer,
            metrics=self._metrics,
            resyncs=self._recovery,
            fenced=self._fenced,
            queue_size=self._config.queue_size,
            max_queued_events=self._config.max_queued_events,
            max_group=self._config.max_group,
            backoff=self._backoff,
            expected=expected,
            state_known=known,
        )
        self._pods.add_worker(pod, worker)
        pod.tasks.append(watched(worker.run(), f"ingest of {source}"))
        self._refresh_subscribed()
        return worker

    async def _clear(self, pod_id: str) -> None:
        await self._index.remove_pod(pod_id)
        self._uncleared.discard(pod_id)

    async def _stop(self, pod_id: str) -> bool:
        pod = self._pods.pop(pod_id)
        self._discovery.forget(pod_id)
        if pod is None:
            return False
        await cancel_and_wait(pod.tasks)
        for worker in pod.workers.values():
            worker.stopped()
            self._metrics.queue_depth.remove(pod_id, str(worker.source.dp_rank))
        self._recovery.forget({w.source for w in pod.workers.values()})
        self._refresh_subscribed()
        return True

    async def _catch_up(self, pod: FollowedPod, rank: int, from_start: bool) -> SourceWorker:
        """Start rank `rank`'s worker where the index says it stopped, asking the engine's
        replay buffer at once for what it published since (`SourceWorker.catch_up`; from
        seq 0 when the pod's previous worker left the source incomplete): a bind-mode
        pod's ranks otherwise start with their first live batch, and an engine connected
        to a bound SUB before this indexer listened sends none until it stores again."""
        expected, known = await self._resume_point(Source(pod.info.id, rank))
        worker = self.start_worker(pod, rank, expected, known)
        worker.catch_up(from_start=from_start)
        return worker

    async def _subscribe(self, pod: FollowedPod, rank: int, from_start: bool) -> None:
        events = pod.info.kv_events
        assert events.endpoint is not None
        worker = await self._catch_up(pod, rank, from_start)
        subscription = EngineSubscription(
            self._context,
            offset_endpoint(events.endpoint, rank),
            events.topic,
            worker,
            self._metrics,
            self._limits,
        )
        pod.tasks.append(watched(subscription.run(), f"subscription of {worker.source}"))

    async def _resume_point(self, source: Source) -> tuple[int | None, bool]:
        """Where a previous indexer left this source in a shared index (the next seq, or
        None), and whether the index could tell at all."""
        try:
            stats = await self._index.stats(source.pod)
        except IndexUnavailable:
            return None, False
        for s in stats:
            if s.source == source and s.last_seq is not None:
                return s.last_seq + 1, True
        return None, True

    def _refresh_subscribed(self) -> None:
        self._metrics.subscribed.set(sum(len(p.workers) for p in self._pods))

    def _fenced(self, source: Source) -> None:
        """Another indexer holds the pod's lease: stop following it here."""
        if source.pod in self._fencing:
            return
        self._fencing.add(source.pod)
        self._gate.lost(source.pod)
        self._background.spawn(self._stop_fenced(source.pod), f"stopping fenced pod {source.pod}")

    async def _stop_fenced(self, pod_id: str) -> None:
        try:
            await self.remove(pod_id, clear=False)
        finally:
            self._fencing.discard(pod_id)
