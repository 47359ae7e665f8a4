"""The picker's own gRPC transport (`gateway.epp.grpc_h2`) as clients see it, over real
sockets on free ports: what it refuses (unknown methods, unreadable, compressed or
oversized messages, broken HTTP/2) and that each refusal ends only its own call or
connection; large messages split over many frames, both ways, under flow control; the
room a message still arriving holds, and its return however that message ends; the load
a pick holds, released when the client resets the stream or the server stops.

Two clients speak to it: grpc.aio's (an independent implementation of gRPC: what it
accepts, Envoy's gRPC client accepts too), and a hand-made one over h2's client side for
what grpc.aio will not send (a message cut short, a compressed flag, garbage).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    ProcessingRequest,
    ProcessingResponse,
)
from grpc_health.v1 import health_pb2
from h2.config import H2Configuration
from h2.connection import ConnectionState, H2Connection
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    RemoteSettingsChanged,
    ResponseReceived,
    StreamEnded,
    StreamReset,
    TrailersReceived,
)
from h2.settings import SettingCodes, Settings
from prometheus_client import CollectorRegistry, Gauge

from gateway.epp.grpc_calls import Call, Status
from gateway.epp.grpc_h2 import GrpcServer
from gateway.epp.picker import Picker
from gateway.epp.server import EXT_PROC_SERVICE, grpc_server
from gateway.epp.stream import Budget, EppMetrics
from gateway.settings.workers import WorkerSpec
from globalkv.lookup import LookupResult, PodHit
from tests.entry.ext_proc import (
    BUFFERED,
    DUPLEX,
    A,
    B,
    Epp,
    completion,
    limits,
    request,
    routed,
    status,
    streamed,
)
from tests.gateway.fakes import PREFILLS, Cluster, StubLookup, config, make_gateway
from tests.support.net import free_port, until

pytestmark = pytest.mark.timeout(30)

SECS = 5.0
"""How long any one step may take: every wait in these tests is bounded by it."""
PROCESS = f"/{EXT_PROC_SERVICE}/Process"
HEALTH = "/grpc.health.v1.Health"
ECHO = "/test.Echo/Stream"


def _same(data: bytes) -> bytes:
    return data


def frame(message: bytes, *, size: int | None = None, flag: int = 0) -> bytes:
    """`message` as gRPC frames it: a flag byte (1: compressed), its size (`size`
    announces another than the message's own), the message."""
    announced = len(message) if size is None else size
    return bytes([flag]) + announced.to_bytes(4, "big") + message


def messages(data: bytes) -> list[bytes]:
    """The gRPC messages framed in `data`, in order."""
    out, at = [], 0
    while at < len(data):
        size = int.from_bytes(data[at + 1 : at + 5], "big")
        out.append(data[at + 5 : at + 5 + size])
        at += 5 + size
    assert at == len(data), "a message cut short"
    return out


# --- a picker, as Envoy reaches it --------------------------------------------------


@dataclass
class Served:
    """A picker serving on `port`, and a grpc.aio client of it (`epp`)."""

    epp: Epp
    server: GrpcServer
    port: int
    channel: grpc.aio.Channel

    def raw(self, kind: str, path: str) -> Any:
        """A callable of `path` on bytes (`kind`: unary_unary, unary_stream...)."""
        return getattr(self.channel, kind)(
            path, request_serializer=_same, response_deserializer=_same
        )


@contextlib.asynccontextmanager
async def served(
    *, max_payload_size: int | None = None, **stream_limits: Any
) -> AsyncIterator[Served]:
    """A picker over two prefill workers, the prefix held by B (its pick: B, then A),
    with `stream_limits` (`tests.entry.ext_proc.limits`)."""
    hit = LookupResult(block_size=4, blocks=3, pods=[PodHit(B, 0, 3, 12, 3.0)])
    workers = [WorkerSpec(url=u, role="prefill") for u in PREFILLS]
    settings: dict[str, Any] = {"prefill": workers, "decode": []}
    if max_payload_size is not None:
        settings["max_payload_size"] = max_payload_size
    gateway = await make_gateway(Cluster(), config(**settings), lookup=StubLookup(hit))
    picker = Picker(gateway, fallbacks=1, shed_in_flight=2)
    registry = CollectorRegistry()
    server = grpc_server(picker, limits(gateway, **stream_limits), EppMetrics(registry))
    port = free_port()
    await server.start("127.0.0.1", port)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield Served(Epp(gateway, picker, channel, registry), server, port, channel)
    finally:
        await server.stop(0)


async def routes(epp: Epp) -> None:
    """A whole request through the picker, BUFFERED as `globalkv envoy` configures it,
    is routed and leaves nothing held."""
    answers = await asyncio.wait_for(epp.exchange(request(completion(), mode=BUFFERED)), SECS)
    assert routed(answers[-1])[0] == f"{B},{A}"
    assert epp.in_flight(A) == epp.in_flight(B) == 0


async def opened_with_a_pick(epp: Epp) -> Any:
    """A BUFFERED stream whose pick (B) is made and answered, left open: its load held."""
    call = epp.stub.Process()
    headers_message, body_message = request(completion(), mode=BUFFERED)
    await call.write(headers_message)
    assert (await asyncio.wait_for(call.read(), SECS)).HasField("request_headers")
    await call.write(body_message)
    assert routed(await asyncio.wait_for(call.read(), SECS))[0] == f"{B},{A}"
    assert epp.in_flight(B) == 1
    return call


# --- a bare server, with an echo method ------------------------------------------------


def room_of(limit: int) -> Budget:
    """A room of `limit` bytes: the picker's own `Budget`, its gauge in a registry of
    its own."""
    return Budget(limit, Gauge("room_bytes", "bytes held", registry=CollectorRegistry()))


@dataclass
class Echoes:
    """What the echo method's handlers were told, across calls."""

    received: list[bytes] = field(default_factory=list)
    held_at_delivery: list[int] = field(default_factory=list)
    overflows: int = 0
    cancelled: int = 0


class Echo:
    """Writes back each message; ends the call OK once the client has sent all."""

    def __init__(self, call: Call, room: Budget, echoes: Echoes) -> None:
        self._call, self._room, self._echoes = call, room, echoes

    def message(self, data: bytes) -> None:
        if data.startswith(b"fail:"):  # the call ended with the rest as its message
            self._call.finish(Status.INVALID_ARGUMENT, data[5:].decode())
            return
        self._echoes.received.append(data)
        self._echoes.held_at_delivery.append(self._room.held)
        self._call.write(data)

    def half_closed(self) -> None:
        self._call.finish()

    def cancelled(self) -> None:
        self._echoes.cancelled += 1

    def overflow(self) -> None:
        self._echoes.overflows += 1


@dataclass
class Bare:
    server: GrpcServer
    room: Budget
    echoes: Echoes
    port: int
    echo: Callable[..., Any]
    """grpc.aio's stream-stream callable of the echo method, on bytes."""


@contextlib.asynccontextmanager
async def bare(*, max_message: int, room: int) -> AsyncIterator[Bare]:
    """A `GrpcServer` serving `Echo` alone, with a room of `room` bytes."""
    echoes, space = Echoes(), room_of(room)
    server = GrpcServer(
        {ECHO: lambda call: Echo(call, space, echoes)}, max_message=max_message, room=space
    )
    port = free_port()
    await server.start("127.0.0.1", port)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            echo = channel.stream_stream(
                ECHO, request_serializer=_same, response_deserializer=_same
            )
            yield Bare(server, space, echoes, port, echo)
    finally:
        await server.stop(0)


async def echoed(echo: Callable[..., Any], sent: list[bytes]) -> list[bytes]:
    call = echo(iter(sent), timeout=SECS)
    return [message async for message in call]


# --- a gRPC client by hand, over h2 ---------------------------------------------------


@dataclass
class Answer:
    """What one stream of `RawClient` received."""

    headers: dict[bytes, bytes] = field(default_factory=dict)
    """The response's headers and trailers, together."""
    data: bytearray = field(default_factory=bytearray)
    ended: bool = False
    reset: bool = False

    @property
    def grpc_status(self) -> int | None:
        value = self.headers.get(b"grpc-status")
        return None if value is None else int(value)

    def responses(self) -> list[ProcessingResponse]:
        return [ProcessingResponse.FromString(m) for m in messages(bytes(self.data))]


class RawClient:
    """A gRPC client over h2's client side: it sends whatever bytes it is given, as
    DATA frames of the sizes HTTP/2 allows, and reads every stream's answer."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer
        self.h2 = H2Connection(config=H2Configuration(client_side=True, header_encoding=None))
        self.answers: dict[int, Answer] = {}
        self.settled = False
        """The server's SETTINGS came (its windows are known)."""
        self.went_away = False
        self.eof = False
        self.acknowledge = True
        """Give the server window for the data read (False: the windows stay spent)."""

    @classmethod
    @contextlib.asynccontextmanager
    async def connected(cls, port: int, *, window: int | None = None) -> AsyncIterator[RawClient]:
        """Connected to `port`; `window`: each stream's receive window (HTTP/2's
        SETTINGS_INITIAL_WINDOW_SIZE; by default, 65535)."""
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), SECS)
        client = cls(reader, writer)
        try:
            if window is not None:
                client.h2.local_settings = Settings(
                    client=True, initial_values={SettingCodes.INITIAL_WINDOW_SIZE: window}
                )
            client.h2.initiate_connection()
            await client.flush()
            await client.until(lambda: client.settled)
            yield client
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def flush(self) -> None:
        self._writer.write(self.h2.data_to_send())
        await self._writer.drain()

    async def open(self, path: str = PROCESS) -> int:
        sid = self.h2.get_next_available_stream_id()
        self.h2.send_headers(
            sid,
            [
                (b":method", b"POST"),
                (b":scheme", b"http"),
                (b":path", path.encode()),
                (b":authority", b"127.0.0.1"),
                (b"content-type", b"application/grpc"),
                (b"te", b"trailers"),
            ],
        )
        self.answers[sid] = Answer()
        await self.flush()
        return sid

    async def send(self, sid: int, data: bytes, *, end: bool = False) -> None:
        """`data` on stream `sid`, in as many DATA frames as it takes (waiting for the
        server's windows when they are spent); `end`: the last of the stream."""
        while data:
            room = min(self.h2.local_flow_control_window(sid), self.h2.max_outbound_frame_size)
            if room <= 0:
                await self._pump()
                continue
            self.h2.send_data(sid, data[:room])
            data = data[room:]
        if end:
            self.h2.end_stream(sid)
        await self.flush()

    async def reset(self, sid: int) -> None:
        self.h2.reset_stream(sid)
        await self.flush()

    async def until(self, condition: Callable[[], bool]) -> None:
        """Read the server until `condition` holds (at most `SECS`)."""

        async def reading() -> None:
            while not condition():
                await self._pump()

        await asyncio.wait_for(reading(), SECS)

    async def ended(self, sid: int) -> Answer:
        """Stream `sid`'s answer once the server ended or reset it."""
        answer = self.answers[sid]
        await self.until(lambda: answer.ended or answer.reset)
        return answer

    async def _pump(self) -> None:
        data = await self._reader.read(1 << 16)
        if not data:
            self.eof = True
            raise ConnectionError("the server closed the connection")
        for event in self.h2.receive_data(data):
            if isinstance(event, RemoteSettingsChanged):
                self.settled = True
            elif isinstance(event, ConnectionTerminated):
                self.went_away = True
                if event.error_code == 0:
                    # h2 takes any GOAWAY for the connection's end and would refuse
                    # every later frame; HTTP/2 lets the streams it spares go on.
                    self.h2.state_machine.state = ConnectionState.CLIENT_OPEN
            elif isinstance(event, (ResponseReceived, TrailersReceived)):
                self.answers[event.stream_id].headers.update(event.headers or ())
            elif isinstance(event, DataReceived):
                self.answers[event.stream_id].data += event.data
                if self.acknowledge:
                    self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, StreamEnded):
                self.answers[event.stream_id].ended = True
            elif isinstance(event, StreamReset):
                self.answers[event.stream_id].reset = True
        await self.flush()


def body_message(padding: int) -> bytes:
    """A whole body (a completion padded by `padding` bytes) in one serialized message."""
    body = completion(padding="x" * padding)
    message = ProcessingRequest(request_body=HttpBody(body=body, end_of_stream=True))
    return bytes(message.SerializeToString())


def headers_message(mode: int = BUFFERED) -> bytes:
    return bytes(request(b"", mode=mode)[0].SerializeToString())


# --- methods and messages the server refuses ------------------------------------------


async def test_a_method_nobody_serves_is_unimplemented_and_the_server_serves_on() -> None:
    """An unknown path is answered UNIMPLEMENTED at once (trailers only), and neither
    the channel nor the picker is the worse for it."""
    async with served() as s:
        nope = s.raw("unary_unary", "/nope.Service/Method")
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await nope(b"anything", timeout=SECS)
        assert failed.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "/nope.Service/Method" in (failed.value.details() or "")
        await routes(s.epp)


@pytest.mark.parametrize("method", ["Watch", "List"])
async def test_health_watch_and_list_are_unimplemented(method: str) -> None:
    """Only Check is served (what Kubernetes' and Envoy's probes call); the others say so
    instead of hanging the caller."""
    async with served() as s:
        ask = health_pb2.HealthCheckRequest(service="").SerializeToString()
        if method == "Watch":
            watch = s.raw("unary_stream", f"{HEALTH}/Watch")
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                _ = [m async for m in watch(ask, timeout=SECS)]
        else:
            listing = s.raw("unary_unary", f"{HEALTH}/List")
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await listing(ask, timeout=SECS)
        assert failed.value.code() == grpc.StatusCode.UNIMPLEMENTED
        answer = await s.epp.health.Check(health_pb2.HealthCheckRequest(), timeout=SECS)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING


async def test_a_health_check_whose_body_is_no_request_is_invalid_argument() -> None:
    async with served() as s:
        check = s.raw("unary_unary", f"{HEALTH}/Check")
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await check(b"\xff\xff\xff", timeout=SECS)
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        answer = await s.epp.health.Check(health_pb2.HealthCheckRequest(), timeout=SECS)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING


async def test_an_unreadable_processing_request_aborts_its_stream_and_no_other() -> None:
    """Garbage where a ProcessingRequest belongs is INVALID_ARGUMENT for that stream; a
    stream open beside it, on the same connection, goes on to its pick and end."""
    async with served() as s:
        beside = s.epp.stub.Process()
        first, body = request(completion(), mode=BUFFERED)
        await beside.write(first)
        assert (await asyncio.wait_for(beside.read(), SECS)).HasField("request_headers")

        garbage = s.raw("stream_stream", PROCESS)(iter([b"\xff\xff\xff"]), timeout=SECS)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            _ = [m async for m in garbage]
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        await beside.write(body)
        assert routed(await asyncio.wait_for(beside.read(), SECS))[0] == f"{B},{A}"
        await beside.done_writing()
        assert await asyncio.wait_for(beside.read(), SECS) is grpc.aio.EOF
        assert await beside.code() == grpc.StatusCode.OK
        assert s.epp.in_flight(B) == 0


async def test_a_message_over_max_message_is_resource_exhausted_and_one_at_it_is_not() -> None:
    """`max_message` is the largest message taken: one byte more ends the call
    RESOURCE_EXHAUSTED, the handler never seeing it; one at the limit is echoed."""
    async with bare(max_message=1000, room=1 << 20) as b:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await echoed(b.echo, [b"a" * 1001])
        assert failed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "1001" in (failed.value.details() or "")
        assert b.echoes.received == []
        assert await echoed(b.echo, [b"b" * 1000]) == [b"b" * 1000]
        assert b.room.held == 0


async def test_a_message_announced_over_max_message_is_refused_before_it_arrives() -> None:
    """The size in the frame's prefix is enough: the call ends RESOURCE_EXHAUSTED before
    the rest comes, and nothing is taken of the room for it."""
    async with bare(max_message=1000, room=1 << 20) as b, RawClient.connected(b.port) as raw:
        sid = await raw.open(ECHO)
        await raw.send(sid, frame(b"x" * 10, size=50_000))
        answer = await raw.ended(sid)
        assert answer.grpc_status == Status.RESOURCE_EXHAUSTED
        assert b.room.held == 0
        assert b.echoes.received == []


async def test_a_compressed_message_is_unimplemented() -> None:
    """Compression is not served: a message flagged compressed ends its call
    UNIMPLEMENTED, whole or cut short, and the picker holds nothing for it."""
    async with served() as s, RawClient.connected(s.port) as raw:
        whole = await raw.open()
        await raw.send(whole, frame(headers_message(), flag=1))
        partial = await raw.open()
        await raw.send(partial, frame(b"x" * 10, size=100_000, flag=1))
        for sid in (whole, partial):
            answer = await raw.ended(sid)
            assert answer.grpc_status == Status.UNIMPLEMENTED
            assert b"compressed" in answer.headers.get(b"grpc-message", b"")
            assert answer.data == b""
        assert s.epp.buffered() == 0
        await routes(s.epp)


async def test_a_client_that_breaks_http2_is_disconnected_and_others_are_served() -> None:
    """Bytes that are no HTTP/2 connection preface close that connection (after what
    the server had sent), and the picker serves a gRPC client next."""
    async with served() as s:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", s.port), SECS)
        try:
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 64)
            await writer.drain()

            async def until_closed() -> None:
                with contextlib.suppress(ConnectionResetError):
                    while await reader.read(1 << 16):
                        pass

            await asyncio.wait_for(until_closed(), SECS)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        await until(lambda: not s.server.connections, "the broken connection forgotten")
        await routes(s.epp)


# --- large messages, both ways --------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "max_payload_size"),
    [(300_000, None), (2_500_000, 4_000_000)],
    ids=["300KB", "2.5MB"],
)
async def test_a_large_body_in_one_message_is_reassembled_and_streamed_back_intact(
    size: int, max_payload_size: int | None
) -> None:
    """One message arriving over many HTTP/2 frames is handed over whole; its answer,
    many times grpc.aio's 64 KiB window, is queued and sent as the client's windows
    open, every byte in order."""
    async with served(max_payload_size=max_payload_size) as s:
        large = completion(padding="".join(chr(97 + i % 26) for i in range(size)))
        answers = await asyncio.wait_for(
            s.epp.exchange(request(large, mode=DUPLEX, pieces=1)), SECS
        )
        assert routed(answers[0])[0] == f"{B},{A}"
        body, ends = streamed(answers[1:])
        assert body == large
        assert ends == [False] * (len(ends) - 1) + [True]
        assert s.epp.buffered() == 0
        assert s.epp.in_flight(B) == 0


async def test_messages_are_cut_out_of_frames_however_the_frames_fall() -> None:
    """Two messages in one DATA frame and a third split over three: each handed over
    whole, in order, and the room held meanwhile given back before it is."""
    async with bare(max_message=1 << 20, room=1 << 20) as b, RawClient.connected(b.port) as raw:
        sid = await raw.open(ECHO)
        third = bytes(range(256)) * 40
        await raw.send(sid, frame(b"one") + frame(b"two"))
        data = frame(third)
        await raw.send(sid, data[:3])  # not even the whole prefix
        await raw.send(sid, data[3:5000])
        await until(lambda: b.room.held == len(third), "the third's size held")
        await raw.send(sid, data[5000:], end=True)
        answer = await raw.ended(sid)
        assert answer.grpc_status == Status.OK
        assert messages(bytes(answer.data)) == [b"one", b"two", third]
        assert b.echoes.received == [b"one", b"two", third]
        assert b.echoes.held_at_delivery == [0, 0, 0]
        assert b.room.held == 0


async def test_many_calls_on_one_connection_share_the_windows_and_each_gets_all_its_data() -> None:
    """Answers of many calls at once, far over the client's windows: each call's data
    queued apart and drained as windows open, none lost, mixed up or reordered."""
    async with bare(max_message=1 << 20, room=1 << 30) as b:
        sent = [[bytes([i]) * 200_000, bytes([100 + i]) * 150_000] for i in range(12)]
        got = await asyncio.wait_for(asyncio.gather(*(echoed(b.echo, each) for each in sent)), SECS)
        assert got == sent


async def test_data_held_back_goes_when_the_client_raises_its_initial_window() -> None:
    """A client may open its streams' windows by SETTINGS (INITIAL_WINDOW_SIZE, as
    grpc's core does as it measures the link) instead of WINDOW_UPDATE frames: what was
    held back for the window must go then too (RFC 9113 6.9.2)."""
    async with (
        bare(max_message=1 << 20, room=1 << 20) as b,
        RawClient.connected(b.port, window=1000) as raw,
    ):
        raw.acknowledge = False
        sid = await raw.open(ECHO)
        message = bytes(range(256)) * 80
        await raw.send(sid, frame(message), end=True)
        await raw.until(lambda: len(raw.answers[sid].data) == 1000)
        raw.h2.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: 1 << 20})
        await raw.flush()
        answer = await raw.ended(sid)
        assert answer.grpc_status == Status.OK
        assert messages(bytes(answer.data)) == [message]


async def test_a_status_message_reaches_the_client_as_the_handler_gave_it() -> None:
    """`grpc-message` is percent-encoded (HTTP/2 header values are ASCII): a message
    with `%`, non-ASCII and a line break arrives unchanged."""
    details = "100% sure: café ✓\nnext line"
    async with bare(max_message=1000, room=1000) as b:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await echoed(b.echo, [b"fail:" + details.encode()])
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert failed.value.details() == details


# --- the room a message still arriving holds --------------------------------------------


async def test_a_message_still_arriving_holds_its_size_and_one_past_the_room_is_503() -> None:
    """The picker's request bodies and the transport's messages in progress share
    `--max-buffered-bytes`: a body message announced, not yet whole, holds its declared
    size; a second that would pass the limit is answered 503 (bodies_full) at its prefix,
    holding nothing; the first then completes and is routed, and all is given back."""
    async with served(buffered_bytes=1_000_000) as s, RawClient.connected(s.port) as raw:
        first = body_message(600_000)
        held = await raw.open()
        await raw.send(held, frame(headers_message()))
        await raw.until(lambda: len(raw.answers[held].data) > 0)  # the headers' answer
        await raw.send(held, frame(first)[:20_000])
        await until(lambda: s.epp.buffered() == len(first), "the first body's size held")

        refused = await raw.open()
        await raw.send(refused, frame(headers_message()))
        await raw.send(refused, frame(body_message(600_000))[:20_000])
        answer = await raw.ended(refused)
        assert answer.grpc_status == Status.OK  # the picker ended it, with its answer
        [headers_answer, full] = answer.responses()
        assert headers_answer.HasField("request_headers")
        assert status(full) == 503
        assert full.immediate_response.details == "bodies_full"
        assert s.epp.buffered() == len(first)

        await raw.send(held, frame(first)[20_000:])
        await raw.until(lambda: len(raw.answers[held].responses()) == 2)
        assert routed(raw.answers[held].responses()[1])[0] == f"{B},{A}"
        assert s.epp.in_flight(B) == 1
        await raw.send(held, b"", end=True)
        assert (await raw.ended(held)).grpc_status == Status.OK
        assert s.epp.buffered() == 0
        assert s.epp.in_flight(B) == 0
        await routes(s.epp)


async def test_overflow_without_an_answer_from_the_handler_is_resource_exhausted() -> None:
    """A handler whose `overflow` does not end the call: the transport ends it
    RESOURCE_EXHAUSTED; nothing is held for the dropped message."""
    async with bare(max_message=1 << 20, room=1000) as b, RawClient.connected(b.port) as raw:
        sid = await raw.open(ECHO)
        await raw.send(sid, frame(b"x" * 100, size=5000))
        answer = await raw.ended(sid)
        assert answer.grpc_status == Status.RESOURCE_EXHAUSTED
        assert b.echoes.overflows == 1
        assert b.room.held == 0
        assert await echoed(b.echo, [b"y" * 900]) == [b"y" * 900]


@pytest.mark.parametrize("how", ["reset", "disconnected"])
async def test_a_message_cut_short_by_the_client_gives_its_room_back(how: str) -> None:
    """Whether the client resets the stream or drops the connection mid-message, the
    room its declared size held is given back."""
    async with served(buffered_bytes=1_000_000) as s:
        message = body_message(500_000)
        async with RawClient.connected(s.port) as raw:
            sid = await raw.open()
            await raw.send(sid, frame(headers_message()))
            await raw.send(sid, frame(message)[:10_000])
            await until(lambda: s.epp.buffered() == len(message), "the body's size held")
            if how == "reset":
                await raw.reset(sid)
                await until(lambda: s.epp.buffered() == 0, "the room given back")
        await until(lambda: s.epp.buffered() == 0, "the room given back")
        await routes(s.epp)


async def test_a_message_cut_short_by_the_body_deadline_gives_its_room_back() -> None:
    """The picker ends a stream whose body does not arrive in time (408) while the
    transport still holds the room for the message in progress: ending the call gives
    that back too."""
    async with served(buffered_bytes=1_000_000, body_secs=0.2) as s:
        message = body_message(500_000)
        async with RawClient.connected(s.port) as raw:
            sid = await raw.open()
            await raw.send(sid, frame(headers_message()))
            await raw.send(sid, frame(message)[:10_000])
            answer = await raw.ended(sid)
            assert [status(r) for r in answer.responses()] == [0, 408]
            assert s.epp.buffered() == 0


# --- loads released however a stream ends ----------------------------------------------


async def test_a_client_reset_of_a_stream_holding_a_pick_releases_its_load() -> None:
    """Envoy resets the stream when the client goes: the pick's load ends with it."""
    async with served() as s:
        call = await opened_with_a_pick(s.epp)
        call.cancel()
        await until(lambda: s.epp.in_flight(B) == 0, "the load released")
        await routes(s.epp)


async def test_stop_lets_a_call_end_within_the_grace_and_returns_when_it_does() -> None:
    """Stopping tells clients GOAWAY; a call open then goes on (Envoy finishing the
    response: its frames, window updates among them, still taken), a stream opened
    after it is refused, and stop returns as soon as the last call has ended, not at
    the grace's end."""
    async with served() as s, RawClient.connected(s.port) as raw:
        sid = await raw.open()
        await raw.send(sid, frame(headers_message()))
        await raw.send(sid, frame(body_message(100)))
        await raw.until(lambda: len(raw.answers[sid].responses()) == 2)
        assert s.epp.in_flight(B) == 1
        stopping = asyncio.ensure_future(s.server.stop(60))
        await raw.until(lambda: raw.went_away)
        late = await raw.open()
        assert (await raw.ended(late)).reset
        assert not stopping.done()
        await raw.send(sid, b"", end=True)
        answer = await raw.ended(sid)
        assert (answer.grpc_status, answer.reset) == (Status.OK, False)
        await asyncio.wait_for(stopping, SECS)
        assert s.epp.in_flight(B) == 0


@pytest.mark.xfail(
    strict=True,
    raises=ConnectionError,
    reason="h2 closes its connection state on a GOAWAY received and takes the client's "
    "later frames for protocol errors: the server cuts the connection",
)
async def test_a_client_going_away_may_still_finish_its_open_calls() -> None:
    """A client's GOAWAY (a data plane draining its connection) says it opens no more
    streams; those open finish: the server still takes their frames and answers."""
    async with served() as s, RawClient.connected(s.port) as raw:
        sid = await raw.open()
        await raw.send(sid, frame(headers_message()))
        await raw.until(lambda: len(raw.answers[sid].data) > 0)
        raw.h2.close_connection()
        raw.h2.state_machine.state = ConnectionState.CLIENT_OPEN  # as in `_pump`
        await raw.flush()
        await raw.send(sid, frame(body_message(100)))
        await raw.until(lambda: len(raw.answers[sid].responses()) == 2)
        await raw.send(sid, b"", end=True)
        assert (await raw.ended(sid)).grpc_status == Status.OK
        assert s.epp.in_flight(B) == 0


async def test_stop_returns_when_the_last_open_call_is_reset_not_at_the_grace() -> None:
    """A call the client resets while the server stops is over: stop returns then, as it
    does when a call ends, not after the whole grace."""
    async with served() as s:
        call = await opened_with_a_pick(s.epp)
        stopping = asyncio.ensure_future(s.server.stop(60))
        await until(lambda: all(c._last_stream is not None for c in s.server.connections), "GOAWAY")
        assert not stopping.done()
        call.cancel()
        await asyncio.wait_for(stopping, SECS)
        await until(lambda: s.epp.in_flight(B) == 0, "the load released")


async def test_stop_after_the_grace_cuts_open_calls_releases_their_load_and_listens_no_more() -> (
    None
):
    """A stream still open when the grace ends is cut: stop returns, the client sees its
    call end, the pick's load is released, and no new connection is taken."""
    async with served() as s:
        call = await opened_with_a_pick(s.epp)
        loop = asyncio.get_running_loop()
        began = loop.time()
        await asyncio.wait_for(s.server.stop(0.2), SECS)
        assert loop.time() - began >= 0.2  # the call had its grace
        with pytest.raises(grpc.aio.AioRpcError) as cut:
            await asyncio.wait_for(call.read(), SECS)
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
        await until(lambda: s.epp.in_flight(B) == 0, "the load released")
        assert not s.server.connections
        with pytest.raises(ConnectionRefusedError):
            await asyncio.wait_for(asyncio.open_connection("127.0.0.1", s.port), SECS)


async def test_a_reset_read_with_the_message_it_follows_ends_the_call_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client's message and its reset of the stream can come in one read of the
    socket: the answer then finds the stream already closed by h2. The call just ends
    (cancelled), nothing is logged as a failure and the connection serves on."""
    async with served() as s, RawClient.connected(s.port) as raw:
        check = health_pb2.HealthCheckRequest(service="liveness").SerializeToString()
        sid = raw.h2.get_next_available_stream_id()
        raw.h2.send_headers(
            sid,
            [
                (b":method", b"POST"),
                (b":scheme", b"http"),
                (b":path", f"{HEALTH}/Check".encode()),
                (b":authority", b"127.0.0.1"),
                (b"content-type", b"application/grpc"),
            ],
        )
        raw.h2.send_data(sid, frame(check))
        raw.h2.reset_stream(sid)
        raw.answers[sid] = Answer()
        await raw.flush()  # the three frames in one write
        again = await raw.open(f"{HEALTH}/Check")
        await raw.send(again, frame(check), end=True)
        assert (await raw.ended(again)).grpc_status == Status.OK
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
