"""gRPC's server side over HTTP/2, on h2 and asyncio: what the endpoint picker serves
Envoy's ext_proc and gRPC health on.

Why not grpc.aio: an ext_proc stream is one HTTP request, so the cost of a new gRPC
stream is paid per request, and grpc.aio's (the C core's completion queue and polling
thread, a task and a servicer context per call, a batch of operations per message) is
more than the pick's. The least ext_proc server (`bench.epp_minimal`) spends 0.58x the
CPU per request on this module than on grpc.aio at 16 requests at once, 0.74x paced at
600/s, and its Envoy 0.74x/0.99x (`bench.epp`, docs/benchmarks.md "The picker's
transport").

What is served: unary and streaming methods, each message handed to the call's handler
(`CallHandler`) as soon as it is whole, in order; the handler writes messages and ends
the call with a status, synchronously (what HTTP/2 flow control holds back is queued and
sent as the peer's window opens). A message over `max_message` ends its call with
RESOURCE_EXHAUSTED; a message still arriving holds its declared size of the process's
`room` (`Room`, shared with what the handlers hold), and when that is full its handler is
told (`overflow`) instead of the bytes being kept. Not served: compression (a compressed
message ends its call with UNIMPLEMENTED), TLS (the picker listens where only its data
plane reaches it, as it did on grpc.aio's insecure port) and `grpc-timeout` (the
services keep their own deadlines).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from enum import IntEnum
from typing import Protocol, cast
from urllib.parse import quote

from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import (
    DataReceived,
    RequestReceived,
    StreamEnded,
    StreamReset,
    TrailersReceived,
    WindowUpdated,
)
from h2.exceptions import ProtocolError as H2ProtocolError
from h2.settings import SettingCodes, Settings

log = logging.getLogger(__name__)


class Status(IntEnum):
    """The gRPC status codes the services end calls with."""

    OK = 0
    INVALID_ARGUMENT = 3
    NOT_FOUND = 5
    RESOURCE_EXHAUSTED = 8
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14


class CallHandler(Protocol):
    """One call's service side, made by its method's factory when the call opens."""

    def message(self, data: bytes) -> None:
        """A whole message of the call (serialized)."""

    def half_closed(self) -> None:
        """The client has sent all its messages."""

    def cancelled(self) -> None:
        """The client reset the call, or its connection ended: nothing more is sent."""

    def overflow(self) -> None:
        """A message on its way would take the process's `room` past its limit: the
        handler answers as it must (the call is ended with RESOURCE_EXHAUSTED after it,
        unless it ended the call itself); the message's bytes are dropped."""


class Room(Protocol):
    """Bytes the process may hold of requests, shared by the transport and the services."""

    def take(self, size: int) -> bool: ...

    def give(self, size: int) -> None: ...


Method = Callable[["Call"], CallHandler]
_UNQUOTED = " !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~"
"""Printable ASCII but `%`: what gRPC sends of `grpc-message` as it is."""
_HEADERS = [(b":status", b"200"), (b"content-type", b"application/grpc")]
_WINDOW = 1 << 20
"""Each stream's receive window, and (times 16) the connection's: a body of a megabyte
arrives without waiting for a window update."""
_MAX_HEADER_LIST = 64 * 1024
_MAX_STREAMS = 4096
_CONFIG = H2Configuration(
    client_side=False,
    header_encoding=None,
    validate_inbound_headers=True,
    normalize_inbound_headers=False,
    validate_outbound_headers=False,
    normalize_outbound_headers=False,
)


class Call:
    """One gRPC call: its method, and the verbs its handler answers with."""

    __slots__ = (
        "_buffer",
        "_connection",
        "_pending",
        "_reserved",
        "_started",
        "_trailers",
        "done",
        "handler",
        "method",
        "stream_id",
    )

    def __init__(self, connection: _Connection, stream_id: int, method: str) -> None:
        self._connection = connection
        self.stream_id = stream_id
        self.method = method
        self.handler: CallHandler | None = None
        self.done = False
        """Ended (by the handler, the transport or the client): nothing more is sent."""
        self._buffer = bytearray()
        """The start of a message still arriving."""
        self._reserved = 0
        """What the message still arriving holds of the room."""
        self._started = False
        """The response's headers are sent."""
        self._pending: list[bytes] = []
        """Data flow control holds back."""
        self._trailers: list[tuple[bytes, bytes]] | None = None
        """The status, sent once `_pending` is."""

    def write(self, message: bytes) -> None:
        """Send one serialized message (nothing once the call is done)."""
        if not self.done:
            self._connection.send(self, b"\0" + len(message).to_bytes(4, "big") + message)

    def finish(self, status: Status = Status.OK, details: str = "") -> None:
        """End the call with `status` (and `details`, the error's message)."""
        if self.done:
            return
        self.done = True
        trailers = [(b"grpc-status", b"%d" % status)]
        if details:
            trailers.append((b"grpc-message", quote(details, safe=_UNQUOTED).encode()))
        self._connection.end(self, trailers)


class _Connection(asyncio.Protocol):
    """One HTTP/2 connection from a client (Envoy opens a few and multiplexes)."""

    def __init__(self, server: GrpcServer) -> None:
        self._server = server
        self._h2 = H2Connection(config=_CONFIG)
        self._transport: asyncio.Transport | None = None
        self._calls: dict[int, Call] = {}
        self._receiving = False
        """Within `data_received`: what is sent is written once, at its end."""
        self._flush_due = False

    @property
    def open_calls(self) -> int:
        return len(self._calls)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        h2 = self._h2
        h2.local_settings = Settings(
            client=False,
            initial_values={
                SettingCodes.MAX_CONCURRENT_STREAMS: _MAX_STREAMS,
                SettingCodes.INITIAL_WINDOW_SIZE: _WINDOW,
                SettingCodes.MAX_HEADER_LIST_SIZE: _MAX_HEADER_LIST,
            },
        )
        h2.initiate_connection()
        h2.increment_flow_control_window(16 * _WINDOW)
        self._server.connections.add(self)
        self._flush()

    def data_received(self, data: bytes) -> None:
        try:
            events = self._h2.receive_data(data)
        except H2ProtocolError as exc:
            log.warning("gRPC connection closed: the client broke HTTP/2: %s", exc)
            self._flush()
            self.close()
            return
        self._receiving = True
        try:
            for event in events:
                kind = type(event)
                if kind is DataReceived:
                    self._data(event)  # type: ignore[arg-type]
                elif kind is RequestReceived:
                    self._opened(event)  # type: ignore[arg-type]
                elif kind is StreamEnded or kind is TrailersReceived:
                    call = self._calls.get(event.stream_id)  # type: ignore[attr-defined]
                    if call is not None and not call.done and call.handler is not None:
                        call.handler.half_closed()
                elif kind is StreamReset:
                    self._reset(event.stream_id)  # type: ignore[attr-defined]
                elif kind is WindowUpdated:
                    self._drain()
        finally:
            self._receiving = False
            self._flush()

    def _opened(self, event: RequestReceived) -> None:
        sid = event.stream_id
        path = b""
        for name, value in event.headers or ():
            if name == b":path":
                path = bytes(value)
                break
        method = path.decode("latin-1")
        call = Call(self, sid, method)
        self._calls[sid] = call
        factory = self._server.methods.get(method)
        if factory is None:
            call.finish(Status.UNIMPLEMENTED, f"unknown method {method}")
            return
        try:
            call.handler = factory(call)
        except Exception:
            log.exception("gRPC method %s failed to start", method)
            call.finish(Status.INTERNAL, "the service failed")

    def _data(self, event: DataReceived) -> None:
        sid = event.stream_id
        self._h2.acknowledge_received_data(event.flow_controlled_length, sid)
        call = self._calls.get(sid)
        if call is None or call.done:
            return
        data = event.data
        buffer = call._buffer
        if not buffer and len(data) >= 5 and data[0] == 0:
            size = int.from_bytes(data[1:5], "big")
            if len(data) == 5 + size and size <= self._server.max_message:
                self._deliver(call, data[5:])  # the common case: one message, whole
                return
        buffer += data
        self._messages(call)

    def _messages(self, call: Call) -> None:
        buffer = call._buffer
        server = self._server
        while len(buffer) >= 5 and not call.done:
            if buffer[0] != 0:
                call.finish(Status.UNIMPLEMENTED, "compressed messages are not accepted")
                break
            size = int.from_bytes(buffer[1:5], "big")
            if size > server.max_message:
                call.finish(
                    Status.RESOURCE_EXHAUSTED,
                    f"a message of {size} bytes is over the limit of {server.max_message}",
                )
                break
            if len(buffer) < 5 + size:
                if not call._reserved:
                    if not server.room.take(size):
                        call._buffer = bytearray()
                        if call.handler is not None:
                            call.handler.overflow()
                        call.finish(Status.RESOURCE_EXHAUSTED, "the server holds too much")
                        return
                    call._reserved = size
                return
            message = bytes(buffer[5 : 5 + size])
            del buffer[: 5 + size]
            self._give_back(call)
            self._deliver(call, message)
        if call.done:
            self._forget(call)

    def _deliver(self, call: Call, message: bytes) -> None:
        handler = call.handler
        if handler is None:
            return
        try:
            handler.message(message)
        except Exception:
            log.exception("gRPC method %s failed", call.method)
            call.finish(Status.INTERNAL, "the service failed")

    def _give_back(self, call: Call) -> None:
        if call._reserved:
            self._server.room.give(call._reserved)
            call._reserved = 0

    def _forget(self, call: Call) -> None:
        """The call's message in progress no longer holds any room."""
        self._give_back(call)
        call._buffer = bytearray()

    def _reset(self, sid: int) -> None:
        call = self._calls.pop(sid, None)
        if call is None:
            return
        self._forget(call)
        if not call.done:
            call.done = True
            if call.handler is not None:
                call.handler.cancelled()

    def send(self, call: Call, frame: bytes) -> None:
        if not call._started:
            call._started = True
            self._h2.send_headers(call.stream_id, _HEADERS)
        if call._pending:
            call._pending.append(frame)
        else:
            self._send_data(call, frame)
        self._flush_soon()

    def end(self, call: Call, trailers: list[tuple[bytes, bytes]]) -> None:
        self._forget(call)
        if call._pending:
            call._trailers = trailers
            return
        self._send_trailers(call, trailers)
        self._flush_soon()

    def _send_data(self, call: Call, data: bytes) -> None:
        """As much of `data` as the windows allow, the rest kept in order."""
        h2, sid = self._h2, call.stream_id
        try:
            while data:
                size = min(len(data), h2.local_flow_control_window(sid), h2.max_outbound_frame_size)
                if size <= 0:
                    call._pending.append(data)
                    return
                h2.send_data(sid, data[:size])
                data = data[size:]
        except H2ProtocolError:
            self._lost(call)

    def _send_trailers(self, call: Call, trailers: list[tuple[bytes, bytes]]) -> None:
        sid, h2 = call.stream_id, self._h2
        self._calls.pop(sid, None)
        try:
            if call._started:
                h2.send_headers(sid, trailers, end_stream=True)
            else:  # trailers only
                h2.send_headers(sid, _HEADERS + trailers, end_stream=True)
        except H2ProtocolError:
            pass  # the client reset it meanwhile
        self._server.ended(self)

    def _lost(self, call: Call) -> None:
        """The client closed the stream under a send: the call is cancelled."""
        self._calls.pop(call.stream_id, None)
        call._pending.clear()
        if not call.done:
            call.done = True
            if call.handler is not None:
                call.handler.cancelled()
        self._server.ended(self)

    def _drain(self) -> None:
        """The peer opened its windows: the data held back, then what ended after it."""
        for call in list(self._calls.values()):
            pending, call._pending = call._pending, []
            for data in pending:
                if call._pending:
                    call._pending.append(data)
                else:
                    self._send_data(call, data)
            if not call._pending and call._trailers is not None:
                trailers, call._trailers = call._trailers, None
                self._send_trailers(call, trailers)

    def _flush_soon(self) -> None:
        if self._receiving or self._flush_due:
            return
        self._flush_due = True
        asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        data = self._h2.data_to_send()
        if data and self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    def go_away(self) -> None:
        """No new calls (GOAWAY); those open go on."""
        with contextlib.suppress(H2ProtocolError):
            self._h2.close_connection()
        self._flush()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        calls, self._calls = list(self._calls.values()), {}
        for call in calls:
            self._forget(call)
            if not call.done:
                call.done = True
                if call.handler is not None:
                    call.handler.cancelled()
        self._server.connections.discard(self)
        self._server.ended(self)


class GrpcServer:
    """The methods, by path (`/package.Service/Method`), on one listening socket."""

    def __init__(self, methods: Mapping[str, Method], *, max_message: int, room: Room) -> None:
        self.methods = dict(methods)
        self.max_message = max_message
        self.room = room
        self.connections: set[_Connection] = set()
        self._server: asyncio.base_events.Server | None = None
        self._idle: asyncio.Event | None = None

    async def start(self, host: str, port: int) -> None:
        """Listen on `host:port` (`OSError` when it cannot)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self), host, port, reuse_address=True
        )

    def ended(self, connection: _Connection) -> None:
        """A call of `connection` ended: when stopping, the last one wakes `stop`."""
        if self._idle is not None and not any(c.open_calls for c in self.connections):
            self._idle.set()

    async def stop(self, grace: float) -> None:
        """Stop listening, tell every client GOAWAY, let open calls end for up to `grace`
        seconds, then close every connection (what is still open is cancelled)."""
        if self._server is not None:
            self._server.close()
        self._idle = asyncio.Event()
        for connection in list(self.connections):
            connection.go_away()
        if any(c.open_calls for c in self.connections):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), grace)
        for connection in list(self.connections):
            connection.close()
        if self._server is not None:
            await self._server.wait_closed()
