"""Asking a publisher for the batches we missed (PROTOCOLS §4.1 replay).

Replayed batches cross the border here (`border.receive`), as live ones do at the
subscriber: the worker gets `Received` either way.

A DEALER per request, never REQ: one request gets many replies. Both reply layouts
(`[b"", seq, payload]` and `[b"", topic, seq, payload]`) and the end marker are accepted.
ZMQ cannot tell "nobody listens there" from "slow", so an unreachable endpoint shows up
as a timeout: the wait for each reply is bounded, and so is the whole replay. An endpoint
ZMQ refuses outright (a malformed address, an ipc path too long) is no replay endpoint at
all: the outcome is `no_endpoint`, as if none were configured, and the source goes on.

The batches of one replay are held until the worker applies them, so what one replay
holds is bounded in payload bytes too (`max_bytes`), not only in batches: a publisher
answering with large batches would otherwise fill memory (400 of 1 MiB took an indexer
from 79 to 546 MiB). Past it the replay stops (`limit`) and the source is reset as for any
replay that could not fill its range.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Literal

import zmq
import zmq.asyncio

from globalkv.ingest.border import Received, receive
from globalkv.metrics import IngestMetrics
from globalkv.wire import WireError, parse_replay_reply, replay_request

log = logging.getLogger(__name__)

Outcome = Literal["end", "timeout", "malformed", "limit", "no_endpoint"]


@dataclass(slots=True)
class ReplayResult:
    batches: list[Received] = field(default_factory=list)
    outcome: Outcome = "end"
    """end: the publisher said it had nothing more (or we got up to `stop`)."""


class ReplayClient:
    def __init__(
        self,
        context: zmq.asyncio.Context,
        metrics: IngestMetrics,
        *,
        reply_timeout: float = 1.0,
        total_timeout: float = 30.0,
        max_batches: int = 100_000,
        max_message_bytes: int = 64 << 20,
        max_bytes: int = 256 << 20,
    ) -> None:
        self.context = context
        self.metrics = metrics
        self.reply_timeout = reply_timeout
        self.total_timeout = total_timeout
        self.max_batches = max_batches
        self.max_message_bytes = max_message_bytes
        self.max_bytes = max_bytes

    async def fetch(self, endpoint: str, start: int, stop: int, model: str) -> ReplayResult:
        """Buffered batches with `start <= seq < stop` from the replay ROUTER at `endpoint`,
        of a source serving `model`."""
        result = ReplayResult()
        sock = self.context.socket(zmq.DEALER)
        sock.linger = 0
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        try:
            try:
                sock.connect(endpoint)
                await sock.send_multipart(replay_request(start))
            except zmq.ZMQError as exc:
                log.warning("replay endpoint %r refused by ZMQ: %s", endpoint, exc)
                result.outcome = "no_endpoint"
                return result
            deadline = time.monotonic() + self.total_timeout
            held = 0
            while True:
                wait = min(self.reply_timeout, deadline - time.monotonic())
                if wait <= 0 or not await sock.poll(int(wait * 1000)):
                    result.outcome = "timeout"
                    return result
                try:
                    frame = parse_replay_reply(await sock.recv_multipart())
                except WireError:
                    result.outcome = "malformed"
                    return result
                if frame is not None and start <= frame.seq < stop:
                    held += len(frame.payload)
                    if held > self.max_bytes:
                        result.outcome = "limit"
                        return result
                    at = time.monotonic()
                    batch = await receive(frame.seq, frame.payload, model, at, self.metrics)
                    result.batches.append(batch)
                if frame is None or frame.seq >= stop - 1:
                    return result
                if len(result.batches) >= self.max_batches:
                    result.outcome = "limit"
                    return result
        finally:
            sock.close(linger=0)
