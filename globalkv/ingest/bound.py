"""The bound KV-event socket: one SUB that engines connect to, its messages to their sources.

A message names its pod only by its topic (`kv@<pod>@<model>`) and its DP rank only inside
its payload, so it is decoded here before it has a source: checked for a known or
well-formed topic first (garbage is not worth decoding), then decoded, and only a batch
that decoded may name a new pod (`discovery`), so a stray message never makes or
registers one. A rank's worker starts with its first batch, at most `MAX_DP_SIZE` ranks a
pod. The shared socket cannot wait for one source: a full queue drops the batch
(`queue_full`), seen later as a gap.
"""

from __future__ import annotations

import asyncio
import logging

import zmq.asyncio

from globalkv.ingest.border import received
from globalkv.ingest.config import IngestConfig
from globalkv.ingest.discovery import Discovery
from globalkv.ingest.followed import FollowedPods
from globalkv.ingest.following import Following
from globalkv.ingest.subscribers import BoundSubscriber, SubLimits
from globalkv.ingest.tasks import Background
from globalkv.metrics import IngestMetrics
from globalkv.registry import MAX_DP_SIZE
from globalkv.wire import Frame, WireError, decode_batch
from kvplumbing.topics import parse_topic

log = logging.getLogger(__name__)


class BoundSocket:
    def __init__(
        self,
        context: zmq.asyncio.Context,
        config: IngestConfig,
        pods: FollowedPods,
        following: Following,
        discovery: Discovery,
        metrics: IngestMetrics,
        background: Background,
    ) -> None:
        self._context = context
        self._config = config
        self._pods = pods
        self._following = following
        self._discovery = discovery
        self._metrics = metrics
        self._background = background
        self.subscriber: BoundSubscriber | None = None
        self._task: asyncio.Task[None] | None = None
        self.endpoints: list[str] = []
        """The addresses bound, with the real port of a `tcp://127.0.0.1:0`-style one."""

    async def start(self) -> None:
        """Bind every configured endpoint (a bad address fails here) and start reading."""
        if not self._config.bind:
            return
        limits = SubLimits(self._config.rcvhwm, self._config.max_message_bytes)
        self.subscriber = BoundSubscriber(
            self._context, self._config.bind, self.route, self._metrics, limits
        )
        self.endpoints = self.subscriber.bind()
        log.info("bound SUB on %s", ", ".join(self.endpoints))
        self._task = self._background.spawn(self.subscriber.run(), "bound SUB")

    def close(self) -> None:
        if self.subscriber is not None:
            self.subscriber.close()

    @property
    def listening(self) -> bool:
        return self._task is not None and not self._task.done()

    def route(self, frame: Frame, at: float) -> None:
        """One message of the bound SUB to its source's worker, or counted as dropped."""
        try:
            topic = frame.topic.decode()
        except UnicodeDecodeError:
            self._metrics.dropped.labels("unknown_topic").inc()
            return
        if self._pods.by_topic(topic) is None and parse_topic(topic) is None:
            self._metrics.dropped.labels("unknown_topic").inc()  # not worth decoding
            return
        try:
            batch = decode_batch(frame.payload)
        except WireError as exc:
            self._metrics.dropped.labels(exc.reason).inc()
            return
        pod = self._discovery.pod_for(topic)
        if isinstance(pod, str):
            self._metrics.dropped.labels(pod).inc()
            return
        rank = batch.dp_rank or 0
        worker = pod.workers.get(rank)
        if worker is None:
            if rank >= MAX_DP_SIZE:  # each rank costs a worker: not one per number sent
                self._metrics.dropped.labels("bad_dp_rank").inc()
                return
            worker = self._following.start_worker(pod, rank)
        worker.offer(received(frame.seq, batch, pod.info.model, at, self._metrics))
