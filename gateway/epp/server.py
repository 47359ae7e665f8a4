"""`ExternalProcessor.Process` for Envoy's ext_proc filter, and gRPC health, on grpc.aio;
each stream's state is a `gateway.epp.stream.Stream`.

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

A message out of order, or a hint of the wrong shape, aborts that stream with
INVALID_ARGUMENT; a body that is no valid request is the client's 400. Neither touches
any other stream.

Health (`grpc.health.v1.Health/Check`): `liveness` (and "") is SERVING while the process
answers; `readiness` and the ext_proc service name are SERVING until the picker drains
on SIGTERM. A picker with no eligible endpoint stays ready and answers each request 503,
as the protocol describes, instead of being dropped by the data plane.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.epp.picker import Picker
from gateway.epp.protocol import Answers, ProtocolError
from gateway.epp.stream import Budget, EppMetrics, Stream, StreamLimits, Unsupported

log = logging.getLogger(__name__)
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
_MESSAGE_MARGIN = 1024 * 1024
"""What a message may carry beyond its body: headers, metadata, framing."""
_EOF = grpc.aio.EOF
_SWEEP_SECS = 1.0
"""How often the streams' deadlines are checked, at most (shorter deadlines: a quarter)."""


class _Deadlines:
    """Every open stream's deadline, checked by one timer every `interval` while streams
    are open: a timer per stream costs more than the picking does (measured, with
    `bench.epp`: about a sixth of the picker's CPU per request). A stream past its
    deadline is cancelled with `expired` set; a pick's load is released here at once."""

    def __init__(self, interval: float, metrics: EppMetrics) -> None:
        self._interval = interval
        self._metrics = metrics
        self._streams: set[Stream] = set()
        self._timer: asyncio.TimerHandle | None = None

    def add(self, stream: Stream) -> None:
        self._streams.add(stream)
        if self._timer is None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self._interval, self._sweep, loop)

    def discard(self, stream: Stream) -> None:
        self._streams.discard(stream)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        for stream in [s for s in self._streams if s.deadline <= now]:
            self._streams.discard(stream)
            stream.expired = True
            if stream.pick is not None:
                self._metrics.expired.inc()
                stream.release(False)
            if stream.task is not None:
                stream.task.cancel()
        self._timer = loop.call_later(self._interval, self._sweep, loop) if self._streams else None


class ExternalProcessor:
    """The ext_proc service: each stream read and written with `context.read()` and
    `context.write()` of bytes (answers are serialized ahead), under two deadlines."""

    def __init__(self, picker: Picker, limits: StreamLimits, metrics: EppMetrics) -> None:
        self._picker = picker
        self._limits = limits
        self._metrics = metrics
        self._answers = Answers()
        self._budget = Budget(limits.buffered_bytes, metrics.buffered)
        interval = min(_SWEEP_SECS, limits.body_secs / 4, limits.pick_secs / 4)
        self._deadlines = _Deadlines(interval, metrics)

    async def Process(self, _requests: Any, context: Any) -> None:
        """Reads and answers until the pick (Envoy ending the stream, a refusal or the
        body's deadline end it there), then the response's messages until the stream ends,
        which ends the pick's load; past the pick's deadline (its load already released)
        the stream just ends. One coroutine for the stream and one for its pick: the five
        more it had cost about 8,000 instructions a request (counted in-process under
        callgrind), a tenth of what the stream costs beside the minimal server's."""
        read, write = context.read, context.write
        stream = Stream(
            self._picker, self._answers, self._limits, self._budget, self._metrics, write
        )
        stream.task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        stream.deadline = loop.time() + self._limits.body_secs
        self._deadlines.add(stream)
        try:
            try:
                while stream.pick is None:
                    message = await read()
                    if message is _EOF:
                        return
                    answers = stream.receive(message)
                    if answers is None:
                        answers = await stream.routed()
                    for answer in answers:
                        await write(answer)
                    if stream.refused:
                        return
            except asyncio.CancelledError:
                if not _expired(stream):
                    raise
                await write(stream.timed_out())
                return
            stream.deadline = loop.time() + self._limits.pick_secs
            try:
                while True:
                    message = await read()
                    if message is _EOF:
                        stream.release(True)
                        return
                    for answer in stream.after_pick(message):
                        await write(answer)
            except asyncio.CancelledError:
                if not _expired(stream):
                    raise
        except Unsupported as exc:
            self._metrics.streams.inc()
            log.warning("ext_proc stream refused: %s", exc)
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, str(exc))
        except ProtocolError as exc:
            self._metrics.streams.inc()
            log.warning("ext_proc stream aborted: %s", exc)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        finally:
            self._deadlines.discard(stream)
            stream.forget_body()
            stream.release(False)


def _expired(stream: Stream) -> bool:
    """Whether the cancellation just caught was the deadlines' (then taken back, so the
    task goes on to answer), not the RPC's own."""
    if not stream.expired:
        return False
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()
    return True


class Health:
    """`grpc.health.v1.Health/Check` (Watch and List are left unimplemented: the probes of
    Kubernetes and Envoy call Check)."""

    def __init__(self, picker: Picker) -> None:
        self._picker = picker

    async def Check(self, request: Any, context: Any) -> Any:
        service = request.service
        serving = health_pb2.HealthCheckResponse.SERVING
        if service in ("", "liveness"):
            return health_pb2.HealthCheckResponse(status=serving)
        if service in ("readiness", EXT_PROC_SERVICE):
            ready = not self._picker.draining
            status = serving if ready else health_pb2.HealthCheckResponse.NOT_SERVING
            return health_pb2.HealthCheckResponse(status=status)
        await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {service!r}")

    async def Watch(self, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "use Check")

    async def List(self, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "use Check")


def grpc_server(picker: Picker, limits: StreamLimits, metrics: EppMetrics) -> Any:
    """A grpc.aio server with both services, not yet bound or started."""
    largest = limits.body_bytes + _MESSAGE_MARGIN
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", largest),
            ("grpc.max_send_message_length", largest),
        ]
    )
    processor = ExternalProcessor(picker, limits, metrics)
    process = grpc.stream_stream_rpc_method_handler(
        processor.Process, request_deserializer=ProcessingRequest.FromString
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(EXT_PROC_SERVICE, {"Process": process}),)
    )
    health_pb2_grpc.add_HealthServicer_to_server(Health(picker), server)
    return server
