"""The ingest service: which sources exist, their workers and subscriptions, and resync.

Pods come and go through `add_pod` / `remove_pod` (called by the API, the CLI's `--pod`
flags and `podsync`, all idempotent), or appear by themselves on the bound socket
(`discovery.Discovery`). A removed pod's blocks are cleared from the index; if the index
cannot answer then, `clear_removed` (run by podsync too) tries again, so they do not
linger in lookups.

With several indexers on one Redis, `gate` (set by `ownership.Ownership`) says which pods
this one may follow: `add_pod` of another's pod records nothing, and a bound-socket
message of another's pod is dropped (`not_owner`). A
fenced write (`IndexFenced`: the pod's lease is another's now) stops the pod here and
calls `lease_lost`.

When the index reports lost data, every source is rebuilt and `ready` stays False until
all are, so the API answers 503 instead of a lookup against a half-empty index.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

import zmq.asyncio

from globalkv.index.base import Index, IndexUnavailable, Source
from globalkv.ingest.config import IngestConfig
from globalkv.ingest.discovery import Discovery
from globalkv.ingest.followed import FollowedPod, FollowedPods, watched
from globalkv.ingest.replay import ReplayClient
from globalkv.ingest.subscribers import (
    BoundSubscriber,
    EngineSubscription,
    SubLimits,
    replay_endpoint,
)
from globalkv.ingest.worker import Received, SourceWorker
from globalkv.metrics import IngestMetrics
from globalkv.registry import (
    MAX_DP_SIZE,
    PodInfo,
    PodState,
    Registry,
    SourceProgress,
)
from globalkv.wire import Frame, WireError, decode_batch
from kvplumbing.backoff import Backoff
from kvplumbing.endpoints import offset_endpoint
from kvplumbing.tasks import cancel_and_wait
from kvplumbing.topics import parse_topic

__all__ = ["IngestConfig", "IngestService"]  # the config lives in ingest.config, used with this

log = logging.getLogger(__name__)


class IngestService:
    def __init__(
        self,
        index: Index,
        registry: Registry,
        metrics: IngestMetrics,
        config: IngestConfig | None = None,
        *,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.index = index
        self.registry = registry
        self.metrics = metrics
        self.config = config or IngestConfig()
        self.context = context or zmq.asyncio.Context()
        self._own_context = context is None
        self.replayer = ReplayClient(
            self.context,
            reply_timeout=self.config.replay_reply_timeout,
            total_timeout=self.config.replay_total_timeout,
            max_message_bytes=self.config.max_message_bytes,
        )
        self.limits = SubLimits(self.config.rcvhwm, self.config.max_message_bytes)
        self.backoff = Backoff(self.config.retry_base, self.config.retry_cap)
        self._pods = FollowedPods()
        self._uncleared: set[str] = set()
        """Removed pods whose blocks the index could not drop yet."""
        self._resyncing: set[Source] = set()
        self._bound: BoundSubscriber | None = None
        self._bound_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._lock = asyncio.Lock()
        self._source_added = asyncio.Event()
        self.bound_endpoints: list[str] = []
        self.gate: Callable[[str], bool] | None = None
        """Whether this indexer may follow a pod; None: every pod (a single indexer)."""
        self.lease_lost: Callable[[str], None] | None = None
        self._fencing: set[str] = set()
        """Pods being stopped because a write of theirs was fenced."""
        self.discovery = Discovery(
            self._pods,
            lambda: self.registry,
            lambda pod_id: self.gate is None or self.gate(pod_id),
            self._spawn,
            self.config.max_discovered_pods,
        )

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        if self.config.bind:
            self._bound = BoundSubscriber(
                self.context,
                self.config.bind,
                self._route_bound,
                self.metrics,
                self.limits,
            )
            self.bound_endpoints = self._bound.bind()
            log.info("bound SUB on %s", ", ".join(self.bound_endpoints))
            self._bound_task = self._spawn(self._bound.run(), "bound SUB")

    async def stop(self) -> None:
        for pod in self._pods:
            await self._stop_pod(pod.info.id)
        await cancel_and_wait(list(self._background))
        if self._bound is not None:
            self._bound.close()
        if self._own_context:
            self.context.destroy(linger=0)

    # ---------------------------------------------------------------- pods

    def pods(self) -> list[PodInfo]:
        return [p.info for p in self._pods]

    def check_pod(self, info: PodInfo) -> None:
        """Raise `followed.TopicTaken` or `config.EndpointRefused` if `add_pod(info)` would:
        before writing it anywhere."""
        self.config.check_endpoints(info)
        self._pods.check(info)

    async def add_pod(self, info: PodInfo) -> None:
        """Follow a pod (idempotent: a pod already followed with the same info is kept).

        Raises `followed.TopicTaken` when its bound topic names another followed pod, and
        `config.EndpointRefused` when an endpoint's scheme is not allowed.
        """
        if self.gate is not None and not self.gate(info.id):
            return
        async with self._lock:
            current = self._pods.get(info.id)
            if current is not None and current.info == info:
                return
            self.check_pod(info)
            if current is not None:
                await self._stop_pod(info.id)
            self._uncleared.discard(info.id)
            pod = self._pods.add(info)
            if info.kv_events.mode == "connect":
                for rank in range(info.dp_size):
                    await self._start_engine_source(pod, rank)
            elif self._bound is None:
                log.warning("pod %s publishes to a bound SUB, and this indexer binds none", info.id)
            self._refresh_subscribed()

    async def remove_pod(self, pod_id: str, *, clear: bool = True, drain: float = 0.0) -> bool:
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
            existed = await self._stop_pod(pod_id)
        if clear:
            self._uncleared.add(pod_id)
            await self._clear(pod_id)
        return existed

    async def clear_removed(self) -> None:
        """Drop the blocks of removed pods that the index could not drop at the time."""
        for pod_id in sorted(self._uncleared):
            await self._clear(pod_id)

    async def _clear(self, pod_id: str) -> None:
        await self.index.remove_pod(pod_id)
        self._uncleared.discard(pod_id)

    async def _stop_pod(self, pod_id: str) -> bool:
        pod = self._pods.pop(pod_id)
        self.discovery.forget(pod_id)
        if pod is None:
            return False
        await cancel_and_wait(pod.tasks)
        for worker in pod.workers.values():
            worker.stopped()
            self._resyncing.discard(worker.source)
            self.metrics.queue_depth.remove(pod_id, str(worker.source.dp_rank))
        self.metrics.resyncing.set(len(self._resyncing))
        self._refresh_subscribed()
        return True

    async def _start_engine_source(self, pod: FollowedPod, rank: int) -> None:
        events = pod.info.kv_events
        assert events.endpoint is not None
        expected, known = await self._resume_point(Source(pod.info.id, rank))
        worker = self._new_worker(pod, rank, expected, known)
        subscription = EngineSubscription(
            self.context,
            offset_endpoint(events.endpoint, rank),
            events.topic,
            worker,
            self.metrics,
            self.limits,
        )
        pod.tasks.append(watched(subscription.run(), f"subscription of {worker.source}"))

    def _new_worker(
        self, pod: FollowedPod, rank: int, expected: int | None, known: bool = True
    ) -> SourceWorker:
        source = Source(pod.info.id, rank)
        worker = SourceWorker(
            source,
            pod.info.model,
            replay_endpoint(pod.info, rank),
            index=self.index,
            replayer=self.replayer,
            metrics=self.metrics,
            hooks=self,
            queue_size=self.config.queue_size,
            max_group=self.config.max_group,
            backoff=self.backoff,
            expected=expected,
            state_known=known,
        )
        pod.workers[rank] = worker
        pod.tasks.append(watched(worker.run(), f"ingest of {source}"))
        self._refresh_subscribed()
        added, self._source_added = self._source_added, asyncio.Event()
        added.set()
        return worker

    async def _resume_point(self, source: Source) -> tuple[int | None, bool]:
        """Where a previous indexer left this source in a shared index (the next seq, or
        None), and whether the index could tell at all."""
        try:
            stats = await self.index.stats(source.pod)
        except IndexUnavailable:
            return None, False
        for s in stats:
            if s.source == source and s.last_seq is not None:
                return s.last_seq + 1, True
        return None, True

    def _refresh_subscribed(self) -> None:
        self.metrics.subscribed.set(sum(len(p.workers) for p in self._pods))

    # ---------------------------------------------------------------- bound socket

    def _route_bound(self, frame: Frame, at: float) -> None:
        try:
            topic = frame.topic.decode()
        except UnicodeDecodeError:
            self.metrics.dropped.labels("unknown_topic").inc()
            return
        if self._pods.by_topic(topic) is None and parse_topic(topic) is None:
            self.metrics.dropped.labels("unknown_topic").inc()  # not worth decoding
            return
        try:
            batch = decode_batch(frame.payload)
        except WireError as exc:
            self.metrics.dropped.labels(exc.reason).inc()
            return
        # Only now: a message that is not even a batch must not make (or register) a pod.
        pod = self.discovery.pod_for(topic)
        if isinstance(pod, str):
            self.metrics.dropped.labels(pod).inc()
            return
        rank = batch.dp_rank or 0
        worker = pod.workers.get(rank)
        if worker is None:
            if rank >= MAX_DP_SIZE:  # each rank costs a worker: not one per number sent
                self.metrics.dropped.labels("bad_dp_rank").inc()
                return
            worker = self._new_worker(pod, rank, None)
        worker.offer(Received(frame.seq, batch, at))

    async def register_discovered(self) -> None:
        """Write the pods found on the bound socket to the registry (IndexUnavailable
        when it cannot be written: they are tried again on the next call)."""
        await self.discovery.register_discovered()

    # ---------------------------------------------------------------- resync

    @property
    def ready(self) -> bool:
        """False while sources are being rebuilt after the index lost its data."""
        return not self._resyncing

    @property
    def resyncing(self) -> int:
        return len(self._resyncing)

    def data_lost(self, source: Source, lost: frozenset[Source] | None) -> None:
        """Worker hook: rebuild the sources lost; when the whole index was (`lost` None),
        every source, and write our pods back to the registry, which went with it."""
        for worker in self._workers():
            if lost is not None and worker.source not in lost:
                continue
            if worker.source not in self._resyncing:
                self._resyncing.add(worker.source)
                worker.request_resync()
        self.metrics.resyncing.set(len(self._resyncing))
        if lost is None:
            self._spawn(self.restore_registry(), "restoring the pod registry")

    def fenced(self, source: Source) -> None:
        """Worker hook: another indexer holds the pod's lease; stop following it here."""
        if source.pod in self._fencing:
            return
        self._fencing.add(source.pod)
        if self.lease_lost is not None:
            self.lease_lost(source.pod)
        self._spawn(self._stop_fenced(source.pod), f"stopping fenced pod {source.pod}")

    async def _stop_fenced(self, pod_id: str) -> None:
        try:
            await self.remove_pod(pod_id, clear=False)
        finally:
            self._fencing.discard(pod_id)

    def resynced(self, source: Source) -> None:
        self._resyncing.discard(source)
        self.metrics.resyncing.set(len(self._resyncing))
        if not self._resyncing:
            log.info("resync complete")

    async def restore_registry(self) -> None:
        """Write back every pod we follow after the registry's store lost them."""
        try:
            for info in self.pods():
                await self.registry.put(info)
            await self.registry.mark()
        except IndexUnavailable as exc:
            log.warning("could not restore the pod registry yet: %s", exc)

    # ---------------------------------------------------------------- observing

    def _workers(self) -> Iterable[SourceWorker]:
        for pod in self._pods:
            yield from list(pod.workers.values())

    def worker(self, source: Source) -> SourceWorker | None:
        pod = self._pods.get(source.pod)
        return None if pod is None else pod.workers.get(source.dp_rank)

    async def applied(self, source: Source, seq: int, timeout: float = 10.0) -> None:
        """Return once `source`'s batch `seq` (or a later one) is visible in the index."""
        await self.wait(
            source, lambda s: s.last_seq is not None and s.last_seq >= seq, timeout=timeout
        )

    async def wait(
        self, source: Source, condition: Callable[[SourceProgress], bool], timeout: float = 10.0
    ) -> None:
        """Return once `condition` holds for `source`'s ingest state (TimeoutError after
        `timeout`); the source may appear later (bound socket)."""
        async with asyncio.timeout(timeout):
            while (worker := self.worker(source)) is None:
                await self._source_added.wait()
            await worker.wait(condition)

    async def flush(self) -> None:
        """Return once every batch received so far has been applied (or dropped)."""
        await asyncio.gather(*(w.idle() for w in self._workers()))

    def states(self) -> dict[str, PodState]:
        now = time.time()
        listening = self._bound_task is not None and not self._bound_task.done()
        return {
            pod.info.id: pod.state(listening=listening, resyncing=self._resyncing, now=now)
            for pod in self._pods
        }

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = watched(coro, name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def publish_states(self) -> None:
        """Write our ingest state next to each pod in the registry (best effort)."""
        with contextlib.suppress(IndexUnavailable):
            await self.registry.put_states(self.states())
