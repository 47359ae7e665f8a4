"""`ExternalProcessor.Process` for Envoy's ext_proc filter, and gRPC health, on the
picker's own gRPC transport (`gateway.epp.grpc_h2`, which says why not grpc.aio); each
stream's state is a `gateway.epp.stream.Stream`, its messages answered as they come and
its pick, the one step that may wait (a queue, the index), a task of its own.

One gRPC stream is one HTTP request through Envoy. Envoy names its body modes in the
stream's first message (`protocol_config`; a data plane that sends none is taken to use
FULL_DUPLEX_STREAMED, the Endpoint Picker protocol's mode). Two request body modes work:

- BUFFERED (what `globalkv.stack.envoy` configures): the request headers are answered at
  once (Envoy holds the request meanwhile), the whole body follows in one message and its
  answer carries the pick — the header mutation Envoy applies to the headers it still
  holds, the route recomputed. Two messages each way per request;
- FULL_DUPLEX_STREAMED: the body's pieces are buffered to its end, the pick answers the
  request headers and the body is streamed back unchanged.

Any other request body mode cannot give the picker the prompt before the request leaves,
so the stream is ended at once with UNIMPLEMENTED naming the modes that work.

A request without a body is picked on its headers. A body over the gateway's
`--max-payload-size` is the client's 413; a body that would take the request bodies this
process holds past `--max-buffered-bytes` is answered 503, so unfinished large bodies
cannot grow the picker without bound; a body not complete within `--body-timeout-secs`
is answered 408. Streams still receiving their body hold no load.

The load a pick starts is released when the stream ends: Envoy ends it when the HTTP
response ends or the client goes, whichever response phases it sends (none is needed).
When Envoy sends the response's headers they settle the prefill's part and name the
endpoint that served; response body pieces are answered (streamed back in
FULL_DUPLEX_STREAMED), the last one ending the load. A pick holds its load at most
`--pick-timeout-secs`: past it the load is released and the stream ended (Envoy carries
on with the request), so in-flight counts cannot be pinned by streams nobody closes.

A message out of order or unreadable, or a hint of the wrong shape, aborts that stream
with INVALID_ARGUMENT; a body that is no valid request is the client's 400. Neither
touches any other stream.

Health (`grpc.health.v1.Health/Check`): `liveness` (and "") is SERVING while the process
answers; `readiness` and the ext_proc service name are SERVING until the picker drains
on SIGTERM. A picker with no eligible endpoint stays ready and answers each request 503,
as the protocol describes, instead of being dropped by the data plane.
"""

from __future__ import annotations

import asyncio
import logging

from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2

from gateway.epp.grpc_calls import Call, Method, Status
from gateway.epp.grpc_h2 import GrpcServer
from gateway.epp.picker import Picker
from gateway.epp.protocol import Answers, ProtocolError
from gateway.epp.stream import Budget, EppMetrics, Stream, StreamLimits, Unsupported

log = logging.getLogger(__name__)
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
_HEALTH_SERVICE = "grpc.health.v1.Health"
_MESSAGE_MARGIN = 1024 * 1024
"""What a message may carry beyond its body: headers, metadata, framing."""
_SWEEP_SECS = 1.0
"""How often the streams' deadlines are checked, at most (shorter deadlines: a quarter)."""
_RECEIVING, _PICKING, _PICKED = range(3)


class _Deadlines:
    """Every open stream's deadline, checked by one timer every `interval` while streams
    are open: a timer per stream costs more than the picking does (measured, with
    `bench.epp`: about a sixth of the picker's CPU per request)."""

    def __init__(self, interval: float) -> None:
        self._interval = interval
        self._streams: set[_Process] = set()
        self._timer: asyncio.TimerHandle | None = None

    def add(self, stream: _Process) -> None:
        self._streams.add(stream)
        if self._timer is None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self._interval, self._sweep, loop)

    def discard(self, stream: _Process) -> None:
        self._streams.discard(stream)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        for stream in [s for s in self._streams if s.stream.deadline <= now]:
            self._streams.discard(stream)
            stream.expire()
        self._timer = loop.call_later(self._interval, self._sweep, loop) if self._streams else None


class ExternalProcessor:
    """The ext_proc service: what every stream shares (the picker, its limits, the
    serialized answers, the body bytes held, the deadlines); `open` starts a stream."""

    def __init__(self, picker: Picker, limits: StreamLimits, metrics: EppMetrics) -> None:
        self.picker = picker
        self.limits = limits
        self.metrics = metrics
        self.answers = Answers()
        self.budget = Budget(limits.buffered_bytes, metrics.buffered)
        interval = min(_SWEEP_SECS, limits.body_secs / 4, limits.pick_secs / 4)
        self.deadlines = _Deadlines(interval)

    def open(self, call: Call) -> _Process:
        return _Process(self, call)


class _Process:
    """One `ExternalProcessor.Process` stream: messages before the pick answered at
    once; the pick, when due, a task (messages meanwhile wait their turn); after it, the
    response's messages until the stream ends, which ends the pick's load. The body's
    deadline (to the pick) answers 408; the pick's deadline releases its load and ends
    the stream (Envoy carries on with the request)."""

    __slots__ = ("_backlog", "_call", "_closed", "_phase", "_service", "stream")

    def __init__(self, service: ExternalProcessor, call: Call) -> None:
        self._service = service
        self._call = call
        self.stream = Stream(
            service.picker,
            service.answers,
            service.limits,
            service.budget,
            service.metrics,
            call.write,
        )
        self._phase = _RECEIVING
        self._backlog: list[ProcessingRequest] = []
        """Messages that came while the pick was being made."""
        self._closed = False
        """Envoy sent all it will."""
        self.stream.deadline = asyncio.get_running_loop().time() + service.limits.body_secs
        service.deadlines.add(self)

    def message(self, data: bytes) -> None:
        try:
            message = ProcessingRequest.FromString(data)
        except DecodeError:
            self._abort(ProtocolError("a message that is no ProcessingRequest"))
            return
        if self._phase == _PICKING:
            self._backlog.append(message)
            return
        self._answer(message)

    def _answer(self, message: ProcessingRequest) -> None:
        stream, write = self.stream, self._call.write
        try:
            if self._phase == _PICKED:
                for answer in stream.after_pick(message):
                    write(answer)
                return
            answers = stream.receive(message)
        except ProtocolError as exc:
            self._abort(exc)
            return
        if answers is None:
            self._phase = _PICKING
            stream.task = asyncio.get_running_loop().create_task(self._pick())
            return
        for answer in answers:
            write(answer)
        if stream.refused:
            self._end()

    async def _pick(self) -> None:
        stream = self.stream
        try:
            answers = await stream.routed()
        except asyncio.CancelledError:
            if stream.expired:  # the body's deadline, not the stream's end
                self._call.write(stream.timed_out())
                self._end()
            return
        except Exception:
            log.exception("ext_proc pick failed")
            self._end(Status.INTERNAL, "the pick failed")
            return
        finally:
            stream.task = None
        write = self._call.write
        for answer in answers:
            write(answer)
        if stream.refused or self._call.done:
            self._end()
            return
        self._phase = _PICKED
        stream.deadline = asyncio.get_running_loop().time() + self._service.limits.pick_secs
        backlog, self._backlog, call = self._backlog, [], self._call
        for message in backlog:
            self._answer(message)
            if call.done:
                return
        if self._closed:
            self.half_closed()

    def half_closed(self) -> None:
        if self._phase == _PICKING:
            self._closed = True
            return
        self.stream.release(True)
        self._end()

    def cancelled(self) -> None:
        self._phase = _PICKED
        task = self.stream.task
        if task is not None:
            task.cancel()
        self._end()

    def overflow(self) -> None:
        """A body too large for what the process may hold answers 503."""
        self._call.write(self.stream.bodies_full())
        self._end()

    def expire(self) -> None:
        """Past the deadline: the body's (408), or the pick's (its load released)."""
        stream = self.stream
        stream.expired = True
        if self._phase == _PICKING and stream.task is not None:
            stream.task.cancel()  # the pick answers 408
        elif self._phase == _RECEIVING:
            self._call.write(stream.timed_out())
            self._end()
        else:
            if stream.pick is not None:
                self._service.metrics.expired.inc()
            self._end()

    def _abort(self, exc: ProtocolError) -> None:
        self._service.metrics.streams.inc()
        if isinstance(exc, Unsupported):
            log.warning("ext_proc stream refused: %s", exc)
            self._end(Status.UNIMPLEMENTED, str(exc))
        else:
            log.warning("ext_proc stream aborted: %s", exc)
            self._end(Status.INVALID_ARGUMENT, str(exc))

    def _end(self, status: Status = Status.OK, details: str = "") -> None:
        """The stream's end, whoever ends it: its body forgotten, any load released."""
        self._service.deadlines.discard(self)
        stream = self.stream
        stream.forget_body()
        stream.release(False)
        self._call.finish(status, details)


class _Health:
    """`grpc.health.v1.Health/Check` (Watch and List are answered UNIMPLEMENTED: the
    probes of Kubernetes and Envoy call Check). `liveness` (and "") is SERVING while the
    process answers; `readiness` and the ext_proc service until the picker drains."""

    __slots__ = ("_call", "_picker")

    def __init__(self, picker: Picker, call: Call) -> None:
        self._picker = picker
        self._call = call

    def message(self, data: bytes) -> None:
        call = self._call
        try:
            service = health_pb2.HealthCheckRequest.FromString(data).service
        except DecodeError:
            call.finish(Status.INVALID_ARGUMENT, "a message that is no HealthCheckRequest")
            return
        serving = health_pb2.HealthCheckResponse.SERVING
        if service in ("", "liveness"):
            status = serving
        elif service in ("readiness", EXT_PROC_SERVICE):
            ready = not self._picker.draining
            status = serving if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        else:
            call.finish(Status.NOT_FOUND, f"unknown service {service!r}")
            return
        call.write(health_pb2.HealthCheckResponse(status=status).SerializeToString())
        call.finish()

    def half_closed(self) -> None:
        self._call.finish(Status.INVALID_ARGUMENT, "Check takes one HealthCheckRequest")

    def cancelled(self) -> None:
        pass

    def overflow(self) -> None:
        pass


class _Unimplemented:
    __slots__ = ()

    def __init__(self, call: Call, details: str) -> None:
        call.finish(Status.UNIMPLEMENTED, details)

    def message(self, data: bytes) -> None:
        pass

    def half_closed(self) -> None:
        pass

    def cancelled(self) -> None:
        pass

    def overflow(self) -> None:
        pass


def grpc_server(picker: Picker, limits: StreamLimits, metrics: EppMetrics) -> GrpcServer:
    """The server of both services, not yet listening (`GrpcServer.start`)."""
    processor = ExternalProcessor(picker, limits, metrics)
    methods: dict[str, Method] = {
        f"/{EXT_PROC_SERVICE}/Process": processor.open,
        f"/{_HEALTH_SERVICE}/Check": lambda call: _Health(picker, call),
        f"/{_HEALTH_SERVICE}/Watch": lambda call: _Unimplemented(call, "use Check"),
        f"/{_HEALTH_SERVICE}/List": lambda call: _Unimplemented(call, "use Check"),
    }
    largest = limits.body_bytes + _MESSAGE_MARGIN
    return GrpcServer(methods, max_message=largest, room=processor.budget)
