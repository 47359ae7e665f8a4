"""The KV-event publisher of one DP rank: a PUB stream plus a replay ROUTER (PROTOCOLS §4.1).

It behaves as vLLM's and SGLang's `ZmqEventPublisher`: every batch gets the next seq (from
0, back to 0 on restart) and is kept in a bounded buffer; the PUB binds for wildcard, ipc
and inproc endpoints and connects otherwise (so engines can feed one bound indexer SUB);
the ROUTER always binds and answers `[b"", start_seq]` with every buffered batch from that
seq on, then the end marker, in the reply layout of the emulated engine version.

Batches are encoded with `globalkv.wire` in the flavour configured, so the indexer is
tested against the exact bytes it meets in production. Sending happens on a task fed by a
queue; `drain()` awaits that everything published so far was handed to ZMQ, which is how
tests wait for events without sleeping. A batch dropped by fault injection (or published
with `live=False`) still takes its seq and stays replayable: that is the gap an indexer
must notice and repair. The ingest tests drive the same publisher to misbehave in the
other ways an engine or a stranger can: garbage frames (`send_raw`), a buffer that lost
its oldest batches (`forget`), replies held back (`replay_open`), a seq set anywhere.
The PUB is an XPUB, which sends the same, so `wait_subscribed` can tell when a
subscriber's subscription has arrived.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from enginesim.kvcache import CacheChange, Cleared, Removed, Stored
from enginesim.metrics import EngineMetrics
from globalkv.keys import EngineHash
from globalkv.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    Flavor,
    Frame,
    ReplayLayout,
    WireError,
    encode_batch,
    live_frames,
    parse_replay_request,
    replay_end,
    replay_reply,
)
from kvplumbing.clock import WallClock
from kvplumbing.endpoints import endpoint_port

log = logging.getLogger(__name__)

_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]")


def replay_layout_of(flavor: Flavor) -> ReplayLayout:
    """vLLM ≤ 0.23 (the array flavour) answered without the topic frame; newer versions with it."""
    return "seq" if flavor == "vllm-array" else "topic"


def endpoint_binds(endpoint: str) -> bool:
    """The peers' rule: bind wildcard, ipc and inproc endpoints, connect anything else."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    return endpoint_host(endpoint) in _WILDCARD_HOSTS


def endpoint_host(endpoint: str) -> str:
    netloc = endpoint.split("://", 1)[-1]
    return netloc.rsplit(":", 1)[0]


def wire_events(changes: Sequence[CacheChange], page_size: int, flavor: Flavor) -> list[Event]:
    """Cache changes as the KV events an engine of `flavor` with pages of `page_size`
    publishes; a namespaced store names its namespace as that engine does."""
    events: list[Event] = []
    for change in changes:
        if isinstance(change, Stored):
            parent = None if change.parent is None else EngineHash(change.parent)
            namespace = change.namespace
            fields: dict[str, Any] = {"lora_name": namespace.lora_name}
            if flavor == "sglang":
                fields["cache_salt"] = namespace.cache_salt
            else:
                fields["lora_id"] = namespace.lora_id
                fields["extra_keys"] = _vllm_extra_keys(change, len(change.hashes))
            events.append(
                BlockStored(
                    block_hashes=[EngineHash(h) for h in change.hashes],
                    parent_block_hash=parent,
                    token_ids=list(change.token_ids),
                    block_size=page_size,
                    medium="GPU",
                    **fields,
                )
            )
        elif isinstance(change, Removed):
            events.append(BlockRemoved([EngineHash(h) for h in change.hashes], medium="GPU"))
        elif isinstance(change, Cleared):
            events.append(AllBlocksCleared())
    return events


def _vllm_extra_keys(stored: Stored, blocks: int) -> list[list[str] | None]:
    """vLLM's untagged per-block extra keys: the LoRA name on every block, the salt on the
    request's first block only (`generate_block_hash_extra_keys`)."""
    namespace = stored.namespace
    entries: list[list[str] | None] = []
    for block in range(blocks):
        entry = [] if namespace.lora_name is None else [namespace.lora_name]
        if namespace.cache_salt and block == 0 and stored.parent is None:
            entry.append(namespace.cache_salt)
        entries.append(entry or None)
    return entries


@dataclass(frozen=True, slots=True)
class PublisherSettings:
    endpoint: str
    """This rank's PUB endpoint (already offset by the DP rank)."""
    replay_endpoint: str | None
    topic: str
    flavor: Flavor
    dp_rank: int
    buffer_steps: int = 10_000
    hwm: int = 100_000
    layout: ReplayLayout | None = None
    """The replay reply layout; None: the emulated version's (`replay_layout_of`)."""
    bind: bool | None = None
    """Bind the PUB (else connect); None: the peers' rule (`endpoint_binds`)."""


class KVEventPublisher:
    def __init__(
        self,
        settings: PublisherSettings,
        context: zmq.asyncio.Context,
        metrics: EngineMetrics,
        *,
        drop: Callable[[], bool] = lambda: False,
        clock: WallClock = time.time,
    ) -> None:
        self.settings = settings
        self._ctx = context
        self._metrics = metrics
        self._drop = drop
        self._clock = clock
        self._topic = settings.topic.encode()
        self._layout = settings.layout or replay_layout_of(settings.flavor)
        self._rank = str(settings.dp_rank)
        self._seq = 0
        self.buffer: deque[Frame] = deque(maxlen=settings.buffer_steps)
        """The batches a replay can still give, oldest first."""
        self.replay_open = asyncio.Event()
        """Replay requests are answered only while set."""
        self.replay_open.set()
        self._outbox: asyncio.Queue[list[bytes]] = asyncio.Queue()
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.bound_endpoint: str | None = None
        """The PUB endpoint actually bound (port resolved), None when connecting."""
        self.bound_replay_endpoint: str | None = None

    @property
    def next_seq(self) -> int:
        return self._seq

    @next_seq.setter
    def next_seq(self, seq: int) -> None:
        """As if the batches before `seq` had been published (or a new run began)."""
        self._seq = seq

    async def start(self) -> None:
        """Bind or connect the sockets; on a bind error nothing stays open."""
        pub = self._ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.SNDHWM, self.settings.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        self._pub = pub
        endpoint = self.settings.endpoint
        try:
            bind = self.settings.bind
            if endpoint_binds(endpoint) if bind is None else bind:
                pub.bind(endpoint)
                self.bound_endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                pub.connect(endpoint)
            if self.settings.replay_endpoint is not None:
                replay = self._ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                self._replay = replay
                replay.bind(self.settings.replay_endpoint)
                self.bound_replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            await self.stop()
            raise
        self._tasks.append(asyncio.create_task(self._send_loop(), name="kv-events-pub"))
        if self._replay is not None:
            self._tasks.append(asyncio.create_task(self._replay_loop(), name="kv-events-replay"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None

    async def wait_subscribed(self, timeout: float = 10.0) -> None:
        """Return once a subscriber's subscription message reached the PUB."""
        assert self._pub is not None
        async with asyncio.timeout(timeout):
            while (await self._pub.recv())[:1] != b"\x01":
                pass

    def publish(self, events: Sequence[Event], *, live: bool = True) -> int | None:
        """Queue one batch; returns its seq (None for an empty batch, which is not sent).
        Not `live`: only buffered for replay, as a batch the PUB dropped."""
        if not events:
            return None
        payload = encode_batch(
            EventBatch(ts=self._clock(), events=events, dp_rank=self.settings.dp_rank),
            self.settings.flavor,
        )
        seq = self._seq
        self._seq += 1
        self.buffer.append(Frame(self._topic, seq, payload))
        for event in events:
            self._metrics.events.labels(self._rank, type(event).__name__).inc()
        if not live:
            return seq
        if self._drop():
            self._metrics.event_batches.labels(self._rank, "dropped_fault").inc()
            log.info("dp %s: fault dropped KV-event batch seq=%d (live only)", self._rank, seq)
            return seq
        self._outbox.put_nowait(live_frames(self._topic, seq, payload))
        return seq

    def send_raw(self, frames: Sequence[bytes]) -> None:
        """Queue frames as they are, whatever they hold: what a broken peer sends."""
        self._outbox.put_nowait(list(frames))

    async def drain(self) -> None:
        """Return once every batch published so far has been handed to the PUB socket."""
        await self._outbox.join()

    def restart(self) -> None:
        """Seq back to 0 and the replay buffer emptied, as a restarted engine process has."""
        self._seq = 0
        self.buffer.clear()

    def forget(self, keep: int) -> None:
        """Forget all but the last `keep` buffered batches, as a buffer that wrapped."""
        while len(self.buffer) > keep:
            self.buffer.popleft()

    async def _send_loop(self) -> None:
        assert self._pub is not None
        while True:
            frames = await self._outbox.get()
            try:
                await self._pub.send_multipart(frames)
                self._metrics.event_batches.labels(self._rank, "sent").inc()
            finally:
                self._outbox.task_done()

    async def _replay_loop(self) -> None:
        assert self._replay is not None
        while True:
            identity, *request = await self._replay.recv_multipart()
            await self.replay_open.wait()
            try:
                start_seq = parse_replay_request(request)
            except WireError as exc:
                self._metrics.replay_requests.labels(self._rank, "malformed").inc()
                log.warning("dp %s: dropped malformed replay request: %s", self._rank, exc)
                continue
            batches = [frame for frame in self.buffer if frame.seq >= start_seq]
            for frame in batches:
                await self._replay.send_multipart([identity, *replay_reply(frame, self._layout)])
            await self._replay.send_multipart([identity, *replay_end(self._layout)])
            self._metrics.replay_requests.labels(self._rank, "served").inc()
            self._metrics.replayed_batches.labels(self._rank).inc(len(batches))


def describe_kv_events(
    publishers: Sequence[KVEventPublisher], advertise_host: str, block_size: int, dp_size: int
) -> dict[str, object] | None:
    """The `kv_events` block of `/server_info`, so a control plane can subscribe unaided.

    SGLang's keys (`publisher`, `endpoint_host`, `endpoint_port_base`, `topic`,
    `block_size`, `dp_size`, `replay_endpoint_port_base`), except that the host is the one
    this engine is reachable at instead of the bind wildcard, plus ready-to-dial
    `endpoint` / `replay_endpoint` URLs of DP rank 0 and the wire `format`. A publisher
    that connects (to a bound indexer SUB) advertises `"bind": false` and its target.
    """
    if not publishers:
        return None
    first = publishers[0]
    settings = first.settings
    block: dict[str, object] = {
        "publisher": "zmq",
        "topic": settings.topic,
        "block_size": block_size,
        "dp_size": dp_size,
        "format": settings.flavor,
        "bind": first.bound_endpoint is not None,
    }
    if first.bound_endpoint is None:
        block["endpoint"] = settings.endpoint
    elif first.bound_endpoint.startswith("tcp://"):
        port = endpoint_port(first.bound_endpoint)
        block.update(
            endpoint=_dial(advertise_host, port),
            endpoint_host=advertise_host,
            endpoint_port_base=port,
        )
    else:
        block["endpoint"] = first.bound_endpoint
    replay = first.bound_replay_endpoint
    if replay is not None and replay.startswith("tcp://"):
        port = endpoint_port(replay)
        block.update(replay_endpoint=_dial(advertise_host, port), replay_endpoint_port_base=port)
    else:
        block["replay_endpoint"] = replay
    return block


def _dial(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
