"""The two ways events reach the indexer (PROTOCOLS §4.1).

- `EngineSubscription`: the engine binds its PUB (`tcp://*:5557`), we connect one SUB per
  engine DP rank, so every message on it belongs to one known source.
- `BoundSubscriber`: we bind one SUB, engines connect their PUBs to it; a message names its
  pod only by its topic (`kv@<pod>@<model>`) and its DP rank only inside the payload, so
  its frame goes to a router (`bound.BoundSocket.route`) that finds its source.

Malformed frames (wrong count, a seq that is not 8 bytes) are counted and dropped here.
A connected subscription's payload crosses the border here (`border.receive`); a payload
that is no batch still reaches the worker, which counts it and keeps its seq. Each SUB
bounds what it holds (`SubLimits`): a message over the size limit makes ZMQ drop the
sending connection, which the engine re-opens; the lost batch is a gap like any other.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import zmq
import zmq.asyncio

from globalkv.ingest.border import receive
from globalkv.ingest.publishers import ZAP_DOMAIN
from globalkv.ingest.worker import SourceWorker
from globalkv.metrics import IngestMetrics
from globalkv.registry import PodInfo
from globalkv.wire import Frame, WireError, parse_live
from kvplumbing.endpoints import offset_endpoint

log = logging.getLogger(__name__)

T = TypeVar("T")

DRAIN_BURST = 256
"""Messages `drain` reads without waiting before it lets the event loop run: a sender
faster than the reader keeps the queue from ever emptying, and the API, the workers and
every other socket would wait for good."""


def _frames(raw: zmq.Socket[bytes]) -> list[bytes]:
    return raw.recv_multipart(zmq.NOBLOCK)


def with_peer(raw: zmq.Socket[bytes]) -> tuple[list[bytes], str]:
    """A message's frames and its sender's address as ZMQ gives it (`Peer-Address`,
    empty over ipc://): its first frame is read as a ZMQ message to ask."""
    first = raw.recv(zmq.NOBLOCK, copy=False)
    try:
        peer = first.get("Peer-Address")
    except zmq.ZMQError:
        peer = ""
    frames = [first.bytes]
    while raw.getsockopt(zmq.RCVMORE):
        frames.append(raw.recv(zmq.NOBLOCK))
    return frames, str(peer)


def drain(sock: zmq.asyncio.Socket) -> AsyncIterator[list[bytes]]:
    """Every message of `sock`, its frames (`drain_as`)."""
    return drain_as(sock, _frames)


async def drain_as(
    sock: zmq.asyncio.Socket, read: Callable[[zmq.Socket[bytes]], T]
) -> AsyncIterator[T]:
    """Every message of `sock` as `read` takes it (its frames by default): wait until
    readable, then read what is queued without waiting, `DRAIN_BURST` at a time. An
    awaited recv per message costs a future and a poller round; reading a burst through a
    synchronous shadow of the same socket costs a C call."""
    raw: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
    while True:
        await sock.poll()
        for _ in range(DRAIN_BURST):
            try:
                message = read(raw)
            except zmq.Again:
                break
            yield message
        else:
            await asyncio.sleep(0)  # more may be queued: the loop's turn first


def replay_endpoint(info: PodInfo, rank: int) -> str | None:
    """DP rank `rank`'s replay ROUTER; None (no replay: gaps reset) when it has none.

    A bind-mode pod learns its ranks from its batches, so an endpoint that cannot be offset
    (ipc://, a port too high) is found only then: that rank goes without replay.
    """
    replay = info.kv_events.replay_endpoint
    if replay is None:
        return None
    try:
        return offset_endpoint(replay, rank)
    except ValueError as exc:
        log.warning("pod %s DP rank %d has no replay endpoint: %s", info.id, rank, exc)
        return None


@dataclass(frozen=True, slots=True)
class SubLimits:
    rcvhwm: int = 10_000
    """Messages a SUB queues before the engine's PUB drops (a gap, repaired by replay)."""
    max_message_bytes: int = 64 << 20
    """Largest message accepted: anyone who can reach a bound SUB can send one."""

    def socket(self, context: zmq.asyncio.Context, topic: bytes) -> zmq.asyncio.Socket:
        sock = context.socket(zmq.SUB)
        sock.linger = 0
        sock.rcvhwm = self.rcvhwm
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        sock.setsockopt(zmq.SUBSCRIBE, topic)
        return sock


class EngineSubscription:
    def __init__(
        self,
        context: zmq.asyncio.Context,
        endpoint: str,
        topic: str,
        worker: SourceWorker,
        metrics: IngestMetrics,
        limits: SubLimits,
    ) -> None:
        self.context = context
        self.endpoint = endpoint
        self.topic = topic.encode()
        self.worker = worker
        self.metrics = metrics
        self.limits = limits

    async def run(self) -> None:
        sock = self.limits.socket(self.context, self.topic)
        sock.connect(self.endpoint)
        log.info(
            "subscribed to %s (topic %r) for %s", self.endpoint, self.topic, self.worker.source
        )
        try:
            async for frames in drain(sock):
                try:
                    frame = parse_live(frames)
                except WireError as exc:
                    self.metrics.dropped.labels(exc.reason).inc()
                    continue
                if self.topic and frame.topic != self.topic:
                    self.metrics.dropped.labels("unknown_topic").inc()
                    continue
                worker = self.worker
                at = time.monotonic()
                received = await receive(frame.seq, frame.payload, worker.model, at, self.metrics)
                await worker.put(received)
        finally:
            sock.close(linger=0)


class BoundSubscriber:
    def __init__(
        self,
        context: zmq.asyncio.Context,
        endpoints: Sequence[str],
        route: Callable[[Frame, float, str], Awaitable[None]],
        metrics: IngestMetrics,
        limits: SubLimits,
    ) -> None:
        """`route` takes each message with its arrival time and its sender's address."""
        self.context = context
        self.endpoints = list(endpoints)
        self.route = route
        self.metrics = metrics
        self.socket = limits.socket(context, b"")
        self.socket.zap_domain = ZAP_DOMAIN.encode()  # every connection asks `publishers`
        self.bound: list[str] = []

    def bind(self) -> list[str]:
        """Bind every endpoint now (so a bad address fails at start); returns the bound
        addresses, with the real port for `tcp://127.0.0.1:0`-style requests."""
        try:
            for endpoint in self.endpoints:
                self.socket.bind(endpoint)
                self.bound.append(self.socket.getsockopt_string(zmq.LAST_ENDPOINT))
        except zmq.ZMQError:
            self.close()
            raise
        return self.bound

    def close(self) -> None:
        """Also when `run` never started (a task cancelled before its first step)."""
        self.socket.close(linger=0)

    async def run(self) -> None:
        try:
            async for frames, peer in drain_as(self.socket, with_peer):
                try:
                    frame = parse_live(frames)
                except WireError as exc:
                    self.metrics.dropped.labels(exc.reason).inc()
                    continue
                await self.route(frame, time.monotonic(), peer)
        finally:
            self.socket.close(linger=0)
