"""gRPC's server side over HTTP/2, on h2 and asyncio: what the endpoint picker serves
Envoy's ext_proc and gRPC health on; each call's messages and verbs are
`gateway.epp.grpc_calls`'.

Why not grpc.aio: an ext_proc stream is one HTTP request, so the cost of a new gRPC
stream is paid per request, and grpc.aio's (the C core's completion queue and polling
thread, a task and a servicer context per call, a batch of operations per message) is
more than the pick's. The least ext_proc server (`bench.epp_minimal`) spends about 0.7x
the CPU per request on this module that it spends on grpc.aio, closed loop and paced, its
kernel time a twentieth (`bench.epp`, docs/benchmarks.md, "The picker's transport").

Served: unary and streaming methods; a handler writes and ends its call synchronously,
and what HTTP/2 flow control holds back is queued and sent as the client's windows open.
Stopping says GOAWAY and lets open calls end. Not served: TLS (the picker listens where
only its data plane reaches it, as it did on grpc.aio's insecure port) and
`grpc-timeout` (the services keep their own deadlines). Headers are not validated beyond
HPACK's limits: only `:path` is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import cast

from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import (
    DataReceived,
    RemoteSettingsChanged,
    RequestReceived,
    StreamEnded,
    StreamReset,
    TrailersReceived,
    WindowUpdated,
)
from h2.exceptions import ProtocolError as H2ProtocolError
from h2.settings import SettingCodes, Settings
from hyperframe.frame import GoAwayFrame

from gateway.epp.grpc_calls import Call, Limits, Method, Room, Status

log = logging.getLogger(__name__)


_HEADERS = [(b":status", b"200"), (b"content-type", b"application/grpc")]
_WINDOW = 1 << 20
"""Each stream's receive window, and (times 16) the connection's: a body of a megabyte
arrives without waiting for a window update."""
_MAX_HEADER_LIST = 64 * 1024
_MAX_STREAMS = 4096
_CONFIG = H2Configuration(
    client_side=False,
    header_encoding=None,
    validate_inbound_headers=False,
    normalize_inbound_headers=False,
    validate_outbound_headers=False,
    normalize_outbound_headers=False,
)


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
        self._last_stream: int | None = None
        """Once GOAWAY is sent: the last stream it lets open (later ones are refused)."""

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
                    if call is not None:
                        call.half_closed()
                elif kind is StreamReset:
                    self._reset(event.stream_id)  # type: ignore[attr-defined]
                elif kind is WindowUpdated:
                    self._drain()
                elif kind is RemoteSettingsChanged:
                    # a new INITIAL_WINDOW_SIZE opens every stream's window with no
                    # WINDOW_UPDATE (grpc's core opens its windows so)
                    self._drain()
        finally:
            self._receiving = False
            self._flush()

    def _opened(self, event: RequestReceived) -> None:
        sid = event.stream_id
        if self._last_stream is not None and sid > self._last_stream:
            self._h2.reset_stream(sid, ErrorCodes.REFUSED_STREAM)  # opened past GOAWAY
            return
        path = b""
        for name, value in event.headers or ():
            if name == b":path":
                path = bytes(value)
                break
        method = path.decode("latin-1")
        call = Call(self, sid, method, self._server.limits)
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
        if call is not None:
            call.received(event.data)

    def _reset(self, sid: int) -> None:
        call = self._calls.pop(sid, None)
        if call is not None:
            call.cancel()
            self._server.ended(self)

    def send(self, call: Call, frame: bytes) -> None:
        if not call.started:
            call.started = True
            try:
                self._h2.send_headers(call.stream_id, _HEADERS)
            except H2ProtocolError:  # reset by a frame of this batch not yet handled
                self._lost(call)
                return
        if call.pending:
            call.pending.append(frame)
        else:
            self._send_data(call, frame)
        self._flush_soon()

    def end(self, call: Call, trailers: list[tuple[bytes, bytes]]) -> None:
        if call.pending:
            call.trailers = trailers
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
                    call.pending.append(data)
                    return
                h2.send_data(sid, data[:size])
                data = data[size:]
        except H2ProtocolError:
            self._lost(call)

    def _send_trailers(self, call: Call, trailers: list[tuple[bytes, bytes]]) -> None:
        sid, h2 = call.stream_id, self._h2
        self._calls.pop(sid, None)
        try:
            if call.started:
                h2.send_headers(sid, trailers, end_stream=True)
            else:  # trailers only
                h2.send_headers(sid, _HEADERS + trailers, end_stream=True)
        except H2ProtocolError:
            pass  # the client reset it meanwhile
        self._server.ended(self)

    def _lost(self, call: Call) -> None:
        """The client closed the stream under a send: the call is cancelled."""
        self._calls.pop(call.stream_id, None)
        call.cancel()
        self._server.ended(self)

    def _drain(self) -> None:
        """The peer opened its windows: the data held back, then what ended after it."""
        for call in list(self._calls.values()):
            pending, call.pending = call.pending, []
            for data in pending:
                if call.pending:
                    call.pending.append(data)
                else:
                    self._send_data(call, data)
            if not call.pending and call.trailers is not None:
                trailers, call.trailers = call.trailers, None
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
        """No new calls (GOAWAY); those open go on. The frame is written past h2: its
        `close_connection` closes its connection state, and every later frame of the
        client (an open call's data, a window update) would be a protocol error there,
        cutting the calls GOAWAY lets finish. Streams opened after it are refused."""
        if self._last_stream is not None:
            return
        self._last_stream = self._h2.highest_inbound_stream_id
        self._flush()
        if self._transport is not None and not self._transport.is_closing():
            frame = GoAwayFrame(stream_id=0, last_stream_id=self._last_stream)
            self._transport.write(frame.serialize())

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        calls, self._calls = list(self._calls.values()), {}
        for call in calls:
            call.cancel()
        self._server.connections.discard(self)
        self._server.ended(self)


class GrpcServer:
    """The methods, by path (`/package.Service/Method`), on one listening socket."""

    def __init__(self, methods: Mapping[str, Method], *, max_message: int, room: Room) -> None:
        self.methods = dict(methods)
        self.limits = Limits(max_message, room)
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
