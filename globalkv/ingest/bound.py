"""The bound KV-event socket: one SUB that engines connect to, its messages to their sources.

A message names its pod only by its topic (`kv@<pod>@<model>`) and its DP rank only inside
its payload, so it is decoded here before it has a source: checked for a known or
well-formed topic first (garbage is not worth decoding), then decoded, and only a batch
that decoded may name a new pod (`discovery`), so a stray message never makes or
registers one. A rank's worker starts with its first batch, at most `MAX_DP_SIZE` ranks a
pod (and for discovered pods, `Discovery.may_add_source`). The shared socket cannot wait
for one source: a full queue drops the batch (`queue_full`), seen later as a gap.

Who may send at all, and from where for each pod, is `publishers`': a connection from an
address not allowed never delivers a message, and a pod's topic from an address it does
not live at is dropped (`wrong_publisher`) before its payload is decoded. Decoding and
translating run in slices (`border`), so one large batch does not stall the loop.
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq.asyncio

from globalkv.index.base import IndexUnavailable
from globalkv.ingest.border import decode, received
from globalkv.ingest.config import IngestConfig
from globalkv.ingest.discovery import Discovery
from globalkv.ingest.followed import FollowedPod, FollowedPods
from globalkv.ingest.following import Following
from globalkv.ingest.publishers import Publishers, address_of
from globalkv.ingest.subscribers import BoundSubscriber, SubLimits
from globalkv.ingest.tasks import Background
from globalkv.metrics import IngestMetrics
from globalkv.registry import MAX_DP_SIZE
from globalkv.wire import Frame, WireError
from kvplumbing.topics import parse_topic

log = logging.getLogger(__name__)


class BoundSocket:
    def __init__(
        self,
        config: IngestConfig,
        pods: FollowedPods,
        following: Following,
        discovery: Discovery,
        metrics: IngestMetrics,
        background: Background,
    ) -> None:
        self._context = zmq.asyncio.Context()
        """The bound SUB's own: ZMQ asks one authentication handler per context, and
        this one must answer for this socket alone, whoever else shares the caller's."""
        self._config = config
        self._pods = pods
        self._following = following
        self._discovery = discovery
        self._metrics = metrics
        self._background = background
        self.publishers = Publishers(config.allow_publishers, metrics)
        self.subscriber: BoundSubscriber | None = None
        self._task: asyncio.Task[None] | None = None
        self.endpoints: list[str] = []
        """The addresses bound, with the real port of a `tcp://127.0.0.1:0`-style one."""

    async def start(self) -> None:
        """Bind every configured endpoint (a bad address fails here) and start reading,
        the publishers' handler answering first."""
        if not self._config.bind:
            return
        limits = SubLimits(self._config.rcvhwm, self._config.max_message_bytes)
        self.subscriber = BoundSubscriber(
            self._context, self._config.bind, self.route, self._metrics, limits
        )
        self.publishers.listen(self._context)
        self._background.spawn(self.publishers.serve(), "bound SUB's publisher check")
        self.endpoints = self.subscriber.bind()
        log.info("bound SUB on %s", ", ".join(self.endpoints))
        self._task = self._background.spawn(self.subscriber.run(), "bound SUB")
        self._background.spawn(self._forget_idle(), "forgetting idle discovered pods")

    def close(self) -> None:
        if self.subscriber is not None:
            self.subscriber.close()
        self.publishers.close()
        self._context.destroy(linger=0)

    @property
    def listening(self) -> bool:
        return self._task is not None and not self._task.done()

    async def route(self, frame: Frame, at: float, peer: str) -> None:
        """One message of the bound SUB, from `peer`, to its source's worker, or counted
        as dropped."""
        try:
            topic = frame.topic.decode()
        except UnicodeDecodeError:
            self._metrics.dropped.labels("unknown_topic").inc()
            return
        known = self._pods.by_topic(topic)
        if known is None and parse_topic(topic) is None:
            self._metrics.dropped.labels("unknown_topic").inc()  # not worth decoding
            return
        address = address_of(peer)
        if known is not None and not known.accepts(address):
            self._wrong_publisher(known, peer)  # not worth decoding either
            return
        try:
            batch = await decode(frame.payload)
        except WireError as exc:
            self._metrics.dropped.labels(exc.reason).inc()
            return
        pod = self._discovery.pod_for(topic)
        if isinstance(pod, str):
            self._metrics.dropped.labels(pod).inc()
            return
        if not pod.accepts(address):  # the pod may have changed while it decoded
            self._wrong_publisher(pod, peer)
            return
        if pod.home is None and address is not None:
            pod.home = frozenset([address])  # no host registered: where it first spoke from
        pod.last_message = at
        rank = batch.dp_rank or 0
        worker = pod.workers.get(rank)
        if worker is None:
            if rank >= MAX_DP_SIZE:  # each rank costs a worker: not one per number sent
                self._metrics.dropped.labels("bad_dp_rank").inc()
                return
            if not self._discovery.may_add_source(pod):
                self._metrics.dropped.labels("source_limit").inc()
                return
            worker = self._following.start_worker(pod, rank)
        worker.offer(await received(frame.seq, batch, pod.info.model, at, self._metrics))

    def _wrong_publisher(self, pod: FollowedPod, peer: str) -> None:
        self._metrics.dropped.labels("wrong_publisher").inc()
        log.debug("message for pod %s from %s, which it does not live at", pod.info.id, peer)

    async def _forget_idle(self) -> None:
        """Forget discovered pods gone silent, every quarter of the idle time (at most a
        minute apart)."""
        period = min(self._discovery.idle_secs / 4, 60.0)
        while True:
            await asyncio.sleep(period)
            for pod_id in self._discovery.idle(time.monotonic()):
                log.info("forgetting pod %s: discovered on the bound socket, then idle", pod_id)
                try:
                    await self._discovery.unregister(pod_id)
                    await self._following.remove(pod_id)
                except IndexUnavailable as exc:
                    log.warning("pod %s is forgotten once the index answers: %s", pod_id, exc)
                    continue
                self._metrics.forget_pod(pod_id)
