"""`ExternalProcessor.Process` for Envoy's ext_proc filter, and gRPC health, on grpc.aio.

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
from dataclasses import dataclass
from typing import Any

import grpc
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.epp.picker import Pick, Picker, Refusal
from gateway.epp.protocol import (
    Answers,
    ProtocolError,
    body_pieces,
    header_of,
    headers_of,
    refuse,
    served_of,
    subset_of,
)
from gateway.sidecar.chooser import LLMD_PREFILL_HEADER, PREFILL_HEADER

log = logging.getLogger(__name__)
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
_BUFFERED = ProcessingMode.BUFFERED
_DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED
_MESSAGE_MARGIN = 1024 * 1024
"""What a message may carry beyond its body: headers, metadata, framing."""
_SWEEP_SECS = 1.0
"""How often the streams' deadlines are checked, at most (shorter deadlines: a quarter)."""


class EppMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.picks = Counter(
            "globalkv_epp_requests",
            "Requests the endpoint picker answered, by outcome (routed, or refused: "
            "bad_request, too_large, body_timeout, no_endpoint, shed, bodies_full)",
            ["outcome"],
            registry=registry,
        )
        self.streams = Counter(
            "globalkv_epp_stream_errors",
            "ext_proc streams aborted because Envoy's messages broke the protocol or asked "
            "for a body mode the picker cannot pick in",
            registry=registry,
        )
        self.expired = Counter(
            "globalkv_epp_picks_expired",
            "Picks whose load was released by --pick-timeout-secs, their stream still open",
            registry=registry,
        )
        self.buffered = Gauge(
            "globalkv_epp_buffered_bytes",
            "Request body bytes the picker holds now (bounded by --max-buffered-bytes)",
            registry=registry,
        )
        self.routed = self.picks.labels("routed")


@dataclass(frozen=True, slots=True)
class StreamLimits:
    body_bytes: int
    """One request's body, at most (beyond: 413)."""
    buffered_bytes: int
    """Every stream's body bytes held at once, at most (beyond: 503)."""
    body_secs: float
    """From the stream's start to the pick, at most (beyond: 408)."""
    pick_secs: float
    """A pick's load held, at most (beyond: released and the stream ended)."""


_OUTCOMES = {
    400: "bad_request",
    408: "body_timeout",
    413: "too_large",
    429: "shed",
    503: "no_endpoint",
}


class _Budget:
    """The request body bytes every stream of this process holds, bounded; the gauge
    reads it when scraped."""

    __slots__ = ("held", "limit")

    def __init__(self, limit: int, gauge: Gauge) -> None:
        self.limit = limit
        self.held = 0
        gauge.set_function(lambda: self.held)

    def take(self, size: int) -> bool:
        if self.held + size > self.limit:
            return False
        self.held += size
        return True

    def give(self, size: int) -> None:
        self.held -= size


class _Stream:
    """One HTTP request's ext_proc stream: what was received, the pick, its release."""

    __slots__ = (
        "_answers",
        "_body",
        "_budget",
        "_headers",
        "_held",
        "_limits",
        "_metrics",
        "_path",
        "_picker",
        "_subset",
        "buffered",
        "deadline",
        "duplex_response",
        "expired",
        "pick",
        "refused",
        "status",
        "task",
    )

    def __init__(
        self,
        picker: Picker,
        answers: Answers,
        limits: StreamLimits,
        budget: _Budget,
        metrics: EppMetrics,
    ) -> None:
        self._picker = picker
        self._answers = answers
        self._limits = limits
        self._budget = budget
        self._metrics = metrics
        self._path: str | None = None
        self._headers: dict[str, str] = {}
        """The request headers the picker reads (`Picker.wanted_headers`)."""
        self._subset: frozenset[str] | None = None
        self._body = bytearray()
        self._held = 0
        self.buffered = False
        self.duplex_response = True
        self.pick: Pick | None = None
        self.refused = False
        self.status: int | None = None
        """The response's status, once its headers came."""
        self.deadline = 0.0
        """When the body must have come, or (picked) the pick's load stops counting."""
        self.task: asyncio.Task[Any] | None = None
        self.expired = False

    async def receive(self, message: ProcessingRequest) -> list[bytes]:
        """The answers to one message before the pick."""
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            return await self._request_headers(message)
        if self._path is None:
            raise ProtocolError(f"{kind} before the request headers")
        if kind == "request_body":
            return await self._request_body(message.request_body.body, message.request_body)
        if kind == "request_trailers" and not self.buffered:
            return [*await self._routed(end=False), self._answers.request_trailers]
        raise ProtocolError(f"{kind} before the request was routed")

    def after_pick(self, message: ProcessingRequest) -> list[bytes]:
        """The answers to one message after the pick (or after its load ended)."""
        kind = message.WhichOneof("request")
        answers = self._answers
        if kind == "response_headers":
            self._response_headers(message)
            return [answers.response_headers]
        if kind == "response_body":
            chunk = message.response_body
            if chunk.end_of_stream:
                self.release(True)
            if self.duplex_response:
                return list(body_pieces(chunk.body, request=False, end=chunk.end_of_stream))
            return [answers.response_body]
        if kind == "response_trailers":
            self.release(True)
            return [answers.response_trailers]
        if kind == "request_trailers":
            return [answers.request_trailers]
        raise ProtocolError(f"{kind} after the request was routed")

    async def _request_headers(self, message: ProcessingRequest) -> list[bytes]:
        if self._path is not None:
            raise ProtocolError("request headers received twice")
        if message.HasField("protocol_config"):
            config = message.protocol_config
            mode = config.request_body_mode
            if mode not in (_BUFFERED, _DUPLEX):
                raise _Unsupported(
                    f"request body mode {ProcessingMode.BodySendMode.Name(mode)}: the picker "
                    "reads the prompt before the request leaves; configure BUFFERED or "
                    "FULL_DUPLEX_STREAMED"
                )
            self.buffered = mode == _BUFFERED
            self.duplex_response = config.response_body_mode == _DUPLEX
        headers = message.request_headers
        self._path = header_of(headers, ":path") or "/"
        wanted = self._picker.wanted_headers
        if wanted:
            self._headers = {k: v for k, v in headers_of(headers).items() if k in wanted}
        self._subset = subset_of(message.metadata_context)
        if headers.end_of_stream:
            return await self._routed(end=None)
        return [self._answers.request_headers] if self.buffered else []

    async def _request_body(self, chunk: bytes, body: Any) -> list[bytes]:
        size = len(chunk)
        if self._held + size > self._limits.body_bytes:
            limit = self._limits.body_bytes
            return [self._refuse(Refusal(413, f"body over {limit} bytes", "too_large"))]
        if not self._budget.take(size):
            message = "the picker holds as many request bodies as it may; retry"
            return [self._refuse(Refusal(503, message, "bodies_full"))]
        self._held += size
        if self.buffered:  # the whole body, in one message
            return await self._routed(end=True, body=chunk)
        self._body += chunk
        if not body.end_of_stream:
            return []
        return await self._routed(end=True)

    async def _routed(self, end: bool | None, body: bytes | None = None) -> list[bytes]:
        """The pick's answer (`end`: whether the body ends the request; None: the request
        has no body): in the buffered body's answer, else in the request headers' followed
        by the body streamed back."""
        assert self._path is not None
        if body is None:
            body = bytes(self._body)
            self._body = bytearray()
        try:
            outcome = await self._picker.pick(self._path, body, self._subset, self._headers)
        finally:
            self.forget_body()
        if isinstance(outcome, Refusal):
            return [self._refuse(outcome)]
        self.pick = outcome
        self._metrics.routed.inc()
        in_body = self.buffered and end is not None
        removed = () if outcome.headers else _PREFILL_HEADERS
        answers = [
            self._answers.route(outcome.endpoints, outcome.headers, removed, in_body=in_body)
        ]
        if end is not None and not in_body:
            answers += body_pieces(body, request=True, end=end)
        return answers

    def forget_body(self) -> None:
        """The body's bytes no longer count against the process's budget."""
        if self._held:
            self._budget.give(self._held)
            self._held = 0
        self._body = bytearray()

    def _refuse(self, refusal: Refusal) -> bytes:
        self.refused = True
        self.forget_body()
        self._metrics.picks.labels(_OUTCOMES.get(refusal.status, str(refusal.status))).inc()
        return refuse(refusal.status, refusal.message, refusal.code)

    def timed_out(self) -> bytes:
        message = f"the request body did not arrive within {self._limits.body_secs:g} s"
        return self._refuse(Refusal(408, message, "request_timeout"))

    def _response_headers(self, message: ProcessingRequest) -> None:
        pick = self.pick
        if pick is None:
            return
        served = served_of(message.metadata_context)
        if served is not None:
            self._picker.served(pick, served)
        status = header_of(message.response_headers, ":status") or ""
        self.status = int(status) if status.isdigit() else 502
        self._picker.answered(pick, self.status)
        if message.response_headers.end_of_stream:
            self.release(True)

    def release(self, ended: bool) -> None:
        """The pick's load ends; `ended`: the response ended (not the stream cut short).
        Its success is the response's status when its headers came, else its ending."""
        pick = self.pick
        if pick is not None:
            self.pick = None
            succeeded = ended and (self.status is None or self.status < 300)
            self._picker.release(pick, succeeded)


_PREFILL_HEADERS = (PREFILL_HEADER, LLMD_PREFILL_HEADER)
"""Removed from a request sent whole: only the picker names a prefill."""


class _Deadlines:
    """Every open stream's deadline, checked by one timer every `interval` while streams
    are open: a timer per stream costs more than the picking does (measured, with
    `bench.epp`: about a sixth of the picker's CPU per request). A stream past its
    deadline is cancelled with `expired` set; a pick's load is released here at once."""

    def __init__(self, interval: float, metrics: EppMetrics) -> None:
        self._interval = interval
        self._metrics = metrics
        self._streams: set[_Stream] = set()
        self._timer: asyncio.TimerHandle | None = None

    def add(self, stream: _Stream) -> None:
        self._streams.add(stream)
        if self._timer is None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self._interval, self._sweep, loop)

    def discard(self, stream: _Stream) -> None:
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


class _Unsupported(ProtocolError):
    """A processing mode the picker cannot pick in."""


class ExternalProcessor:
    """The ext_proc service: each stream read and written with `context.read()` and
    `context.write()` of bytes (answers are serialized ahead), under two deadlines."""

    def __init__(self, picker: Picker, limits: StreamLimits, metrics: EppMetrics) -> None:
        self._picker = picker
        self._limits = limits
        self._metrics = metrics
        self._answers = Answers()
        self._budget = _Budget(limits.buffered_bytes, metrics.buffered)
        interval = min(_SWEEP_SECS, limits.body_secs / 4, limits.pick_secs / 4)
        self._deadlines = _Deadlines(interval, metrics)

    async def Process(self, _requests: Any, context: Any) -> None:
        stream = _Stream(self._picker, self._answers, self._limits, self._budget, self._metrics)
        stream.task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        stream.deadline = loop.time() + self._limits.body_secs
        self._deadlines.add(stream)
        try:
            if await self._until_picked(stream, context):
                stream.deadline = loop.time() + self._limits.pick_secs
                await self._while_picked(stream, context)
        except _Unsupported as exc:
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

    async def _until_picked(self, stream: _Stream, context: Any) -> bool:
        """Reads and answers until the pick; False: the stream is over (ended by Envoy,
        refused, or out of time for its body)."""
        try:
            while stream.pick is None:
                message = await context.read()
                if message is grpc.aio.EOF:
                    return False
                for answer in await stream.receive(message):
                    await context.write(answer)
                if stream.refused:
                    return False
        except asyncio.CancelledError:
            if not _expired(stream):
                raise
            await context.write(stream.timed_out())
            return False
        return True

    async def _while_picked(self, stream: _Stream, context: Any) -> None:
        """Answers the response's messages until the stream ends, which ends the load;
        past the pick's deadline (its load already released) the stream just ends."""
        try:
            while True:
                message = await context.read()
                if message is grpc.aio.EOF:
                    stream.release(True)
                    return
                for answer in stream.after_pick(message):
                    await context.write(answer)
        except asyncio.CancelledError:
            if not _expired(stream):
                raise


def _expired(stream: _Stream) -> bool:
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
