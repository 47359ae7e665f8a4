"""Both ends of the prefill ⇄ decode handshake over ZMQ PUSH/PULL (messages in `handshake`).

Every prefill rank binds its own PULL socket (the address it registers in the bootstrap
directory); the decode binds one PULL socket for all its ranks. Each side sends with PUSH
sockets kept per peer address.

Prefill and decode receive the same request concurrently, so a decode's per-room request
may reach a prefill rank before the prefill's HTTP request exists: arrivals are kept
(bounded in count and age) until the prefill asks for them. A prefill that fails a room
leaves a short-lived tombstone so a decode arriving late learns the reason at once
instead of waiting for its timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from enginesim.handshake import (
    DecodeAddress,
    HandshakeError,
    KVMetadata,
    RankId,
    Registration,
    StatusMessage,
    parse_status,
    parse_to_prefill,
    registration_frames,
    room_request_frames,
    status_frames,
)
from enginesim.metrics import EngineMetrics
from enginesim.peer_sockets import PushPool, bind_pull
from kvplumbing.clock import Clock

log = logging.getLogger(__name__)


class TransferError(RuntimeError):
    """A handshake step failed; `stage` names it (handshake, connect, transfer)."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(message)
        self.stage = stage


@dataclass(slots=True)
class _Arrival:
    created: float
    dests: dict[RankId, DecodeAddress] = field(default_factory=dict)
    event: asyncio.Event = field(default_factory=asyncio.Event)


class PrefillTransfer:
    def __init__(
        self,
        context: zmq.asyncio.Context,
        metrics: EngineMetrics,
        ranks: Sequence[RankId],
        *,
        bind_host: str,
        advertise_host: str,
        send_timeout: float = 5.0,
        pending_ttl: float = 120.0,
        max_pending: int = 10_000,
        clock: Clock = time.monotonic,
        pool: PushPool | None = None,
    ) -> None:
        self._ctx = context
        self._metrics = metrics
        self._ranks = list(ranks)
        self._bind_host = bind_host
        self._advertise_host = advertise_host
        self._pool = pool or PushPool(context, timeout=send_timeout)
        self._ttl = pending_ttl
        self._max = max_pending
        self._clock = clock
        self._arrivals: OrderedDict[int, _Arrival] = OrderedDict()
        self._tombstones: OrderedDict[int, tuple[float, str]] = OrderedDict()
        self._sessions: dict[RankId, OrderedDict[str, None]] = {r: OrderedDict() for r in ranks}
        self._socks: list[zmq.asyncio.Socket] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self.addresses: dict[RankId, tuple[str, int]] = {}
        """Where each rank listens, as registered in the bootstrap directory."""

    async def start(self) -> None:
        for rank in self._ranks:
            sock, port = bind_pull(self._ctx, self._bind_host)
            self._socks.append(sock)
            self.addresses[rank] = (self._advertise_host, port)
            self._tasks.append(asyncio.create_task(self._receive(rank, sock), name=f"rank {rank}"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for sock in self._socks:
            sock.close(linger=0)
        self._pool.close()
        self._tasks.clear()
        self._socks.clear()

    async def wait_for_decode(
        self, room: int, ranks: Sequence[RankId], timeout: float
    ) -> dict[RankId, DecodeAddress]:
        """Wait until the decode's per-room request reached every rank in `ranks`.

        The room stays known until `send_ready` or `fail` ends it, so a prefill that gives
        up after (or during) the handshake tells every decode rank that reached it.
        """
        arrival = self._arrival(room)
        try:
            async with asyncio.timeout(timeout):
                while not all(rank in arrival.dests for rank in ranks):
                    if self._closing:
                        raise TransferError("handshake", "the prefill is shutting down")
                    arrival.event.clear()
                    await arrival.event.wait()
        except TimeoutError:
            missing = [r.label() for r in ranks if r not in arrival.dests]
            raise TransferError(
                "handshake",
                f"no decode handshake for bootstrap_room {room} on prefill ranks "
                f"{', '.join(missing)} within {timeout:g}s",
            ) from None
        return {rank: arrival.dests[rank] for rank in ranks}

    def stop_waiting(self) -> None:
        """End every handshake wait now, and refuse new ones: the engine is shutting down."""
        self._closing = True
        for arrival in self._arrivals.values():
            arrival.event.set()

    async def send_ready(
        self, room: int, dests: Mapping[RankId, DecodeAddress], metadata: KVMetadata
    ) -> None:
        """Hand every decode rank its KV-ready message; `TransferError` (stage transfer)
        when one could not be sent, after telling every rank the room failed: a prefill
        that answered as if the decode had its KV would leave that decode waiting for it.
        """
        self._arrivals.pop(room, None)
        sent = await asyncio.gather(
            *(
                self._send_status(dest, StatusMessage(room, "success", rank, metadata=metadata))
                for rank, dest in dests.items()
            )
        )
        unsent = [rank.label() for rank, ok in zip(dests, sent, strict=True) if not ok]
        if not unsent:
            return
        reason = f"KV-ready for bootstrap_room {room} not sent to the decode of ranks "
        reason += ", ".join(unsent)
        await asyncio.gather(
            *(
                self._send_status(dest, StatusMessage(room, "failed", rank, reason=reason))
                for rank, dest in dests.items()
            )
        )
        raise TransferError("transfer", reason)

    async def fail(self, room: int, reason: str) -> None:
        """Tell the room's decode (now, or when it arrives) that this prefill gave up."""
        self._tombstones[room] = (self._clock(), reason)
        self._expire()
        arrival = self._arrivals.pop(room, None)
        if arrival is not None:
            await asyncio.gather(
                *(
                    self._send_status(dest, StatusMessage(room, "failed", rank, reason=reason))
                    for rank, dest in arrival.dests.items()
                )
            )

    def _arrival(self, room: int) -> _Arrival:
        arrival = self._arrivals.get(room)
        if arrival is None:
            arrival = self._arrivals[room] = _Arrival(created=self._clock())
            self._expire()
        return arrival

    def _expire(self) -> None:
        """Bound memory: decodes whose prefill request never comes, rooms failed long ago."""
        horizon = self._clock() - self._ttl
        arrivals, tombstones = self._arrivals, self._tombstones
        while arrivals and (
            len(arrivals) > self._max or next(iter(arrivals.values())).created < horizon
        ):
            arrivals.popitem(last=False)
            self._metrics.transfer_dropped.labels("expired").inc()
        while tombstones and (
            len(tombstones) > self._max or next(iter(tombstones.values()))[0] < horizon
        ):
            tombstones.popitem(last=False)

    async def _receive(self, rank: RankId, sock: zmq.asyncio.Socket) -> None:
        sessions = self._sessions[rank]
        while True:
            frames = await sock.recv_multipart()
            try:
                message = parse_to_prefill(frames)
            except HandshakeError as exc:
                self._metrics.transfer_dropped.labels(exc.reason).inc()
                log.warning("rank %s: dropped malformed handshake message: %s", rank.label(), exc)
                continue
            decode = message.decode
            if isinstance(message, Registration):
                sessions[decode.session] = None
                sessions.move_to_end(decode.session)
                while len(sessions) > self._max:
                    sessions.popitem(last=False)
                continue
            room = message.room
            if decode.session not in sessions:
                reason = (
                    f"decode session {decode.session} never registered with rank {rank.label()}"
                )
                await self._send_status(decode, StatusMessage(room, "failed", rank, reason=reason))
                continue
            tombstone = self._tombstones.get(room)
            if tombstone is not None:
                failed = StatusMessage(room, "failed", rank, reason=tombstone[1])
                await self._send_status(decode, failed)
                continue
            await self._send_status(decode, StatusMessage(room, "waiting", rank))
            arrival = self._arrival(room)
            arrival.dests[rank] = decode
            arrival.event.set()

    async def _send_status(self, dest: DecodeAddress, message: StatusMessage) -> bool:
        """True once handed to ZMQ; a failure is counted and logged."""
        try:
            await self._pool.send(dest.ip, dest.port, status_frames(message))
        except (TimeoutError, zmq.ZMQError) as exc:
            self._metrics.transfer_dropped.labels("send_failed").inc()
            log.warning(
                "room %d: status %s to %s:%d not sent: %r",
                message.room,
                message.status,
                dest.ip,
                dest.port,
                exc,
            )
            return False
        return True


class DecodeTransfer:
    def __init__(
        self,
        context: zmq.asyncio.Context,
        metrics: EngineMetrics,
        *,
        bind_host: str,
        advertise_host: str,
        session: str,
        send_timeout: float = 5.0,
    ) -> None:
        self._ctx = context
        self._metrics = metrics
        self._bind_host = bind_host
        self._advertise_host = advertise_host
        self._session = session
        self._pool = PushPool(context, timeout=send_timeout)
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._rooms: dict[int, asyncio.Queue[StatusMessage | None]] = {}
        """Each in-flight room's messages; None in it means: stop waiting, shutting down."""
        self._registered: set[tuple[str, int]] = set()
        self._closing = False
        self.address: DecodeAddress | None = None

    async def start(self) -> None:
        self._sock, port = bind_pull(self._ctx, self._bind_host)
        self.address = DecodeAddress(self._advertise_host, port, self._session)
        self._task = asyncio.create_task(self._receive(self._sock), name="decode-transfer")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._sock is not None:
            self._sock.close(linger=0)
        self._pool.close()
        self._task = self._sock = None

    def stop_waiting(self) -> None:
        """End every exchange in flight now, and refuse new ones: the engine is shutting down."""
        self._closing = True
        for inbox in self._rooms.values():
            inbox.put_nowait(None)

    def forget_registrations(self) -> None:
        """Send step 1 again to every rank next time, as a restarted decode process would."""
        self._registered.clear()

    async def exchange(
        self,
        room: int,
        targets: Mapping[RankId, tuple[str, int]],
        *,
        connect_timeout: float,
        transfer_timeout: float,
        on_connected: Callable[[], None],
    ) -> dict[RankId, KVMetadata]:
        """Steps 1–3 with every target rank; returns each rank's KV metadata, unchecked."""
        if self.address is None:
            raise RuntimeError("DecodeTransfer.start() was not called")
        if self._closing:
            raise TransferError("connect", "the decode is shutting down")
        if room in self._rooms:
            raise TransferError("connect", f"bootstrap_room {room} is already in flight here")
        inbox: asyncio.Queue[StatusMessage | None] = asyncio.Queue()
        self._rooms[room] = inbox
        try:
            for address in targets.values():
                if address not in self._registered:
                    await self._send(address, registration_frames(self.address), "connect")
                    self._registered.add(address)
                await self._send(address, room_request_frames(room, self.address), "connect")
            await self._collect(room, inbox, targets, "waiting", connect_timeout, "connect")
            on_connected()
            ready = await self._collect(
                room, inbox, targets, "success", transfer_timeout, "transfer"
            )
        finally:
            del self._rooms[room]
        metadata: dict[RankId, KVMetadata] = {}
        for rank, message in ready.items():
            assert message.metadata is not None, "parse_status gives every success its metadata"
            metadata[rank] = message.metadata
        return metadata

    async def _send(self, address: tuple[str, int], frames: list[bytes], stage: str) -> None:
        try:
            await self._pool.send(address[0], address[1], frames)
        except (TimeoutError, zmq.ZMQError) as exc:
            raise TransferError(
                stage, f"cannot send to prefill rank at {address[0]}:{address[1]}: {exc!r}"
            ) from None

    async def _collect(
        self,
        room: int,
        inbox: asyncio.Queue[StatusMessage | None],
        targets: Mapping[RankId, tuple[str, int]],
        status: str,
        timeout: float,
        stage: str,
    ) -> dict[RankId, StatusMessage]:
        got: dict[RankId, StatusMessage] = {}
        try:
            async with asyncio.timeout(timeout):
                while len(got) < len(targets):
                    message = await inbox.get()
                    if message is None:
                        raise TransferError(stage, "the decode is shutting down")
                    if message.rank not in targets:
                        self._metrics.transfer_dropped.labels("unexpected_rank").inc()
                        continue
                    if message.status == "failed":
                        self._registered.discard(targets[message.rank])
                        raise TransferError(
                            stage,
                            f"prefill rank {message.rank.label()} failed bootstrap_room "
                            f"{room}: {message.reason}",
                        )
                    if message.status == status:
                        got[message.rank] = message
        except TimeoutError:
            missing = [f"{r.label()} at {a[0]}:{a[1]}" for r, a in targets.items() if r not in got]
            what = "no answer" if stage == "connect" else "no KV-ready message"
            raise TransferError(
                stage,
                f"{what} for bootstrap_room {room} from prefill ranks "
                f"{', '.join(missing)} within {timeout:g}s",
            ) from None
        return got

    async def _receive(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            try:
                message = parse_status(frames)
            except HandshakeError as exc:
                self._metrics.transfer_dropped.labels(exc.reason).inc()
                log.warning("dropped malformed status message: %s", exc)
                continue
            inbox = self._rooms.get(message.room)
            if inbox is None:
                self._metrics.transfer_dropped.labels("unknown_room").inc()
                continue
            inbox.put_nowait(message)
