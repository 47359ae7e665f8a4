"""`ExternalProcessor.Process` for Envoy's ext_proc filter, and gRPC health, on grpc.aio.

One gRPC stream is one HTTP request through Envoy. Its messages, in the order Envoy sends
them with the processing mode `globalkv.stack.envoy` configures (request headers SEND,
request body FULL_DUPLEX_STREAMED, response headers SEND, response body
FULL_DUPLEX_STREAMED or NONE):

1. request headers: the path, and the subset hint in the metadata context; a request
   without a body is picked at once;
2. request body pieces, buffered (up to the gateway's `--max-payload-size`, else 413)
   until the end of the stream; then the pick (`gateway.epp.picker`) is answered as the
   request headers' mutation, and the body is streamed back unchanged;
3. response headers: the endpoint that served (metadata context), and the prefill's load
   settled;
4. response body pieces streamed back; the last one, or the stream's close (a client gone,
   a response without a body mode), releases the load.

A message out of that order, or a hint of the wrong shape, aborts that stream with
INVALID_ARGUMENT; a body that is no valid request is the client's 400. Neither touches
any other stream.

Health (`grpc.health.v1.Health/Check`): `liveness` (and "") is SERVING while the process
answers; `readiness` and the ext_proc service name are SERVING while some request could
be routed (an eligible worker of each role), so Envoy's health checks of its ext_proc
cluster leave a replica that cannot route.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest, ProcessingResponse
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter

from gateway.epp.picker import Pick, Picker, Refusal
from gateway.epp.protocol import (
    ProtocolError,
    body_pieces,
    carry_on_response_headers,
    carry_on_trailers,
    headers_of,
    refuse,
    route_to,
    served_of,
    subset_of,
)
from gateway.sidecar.chooser import LLMD_PREFILL_HEADER, PREFILL_HEADER

log = logging.getLogger(__name__)
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
_MESSAGE_BYTES = 64 * 1024 * 1024
"""The largest gRPC message taken: Envoy sends body pieces far smaller."""


class EppMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.picks = Counter(
            "globalkv_epp_requests",
            "Requests the endpoint picker answered, by outcome (routed, or refused: "
            "bad_request, too_large, no_endpoint, shed)",
            ["outcome"],
            registry=registry,
        )
        self.streams = Counter(
            "globalkv_epp_stream_errors",
            "ext_proc streams aborted because Envoy's messages broke the protocol",
            registry=registry,
        )


_OUTCOMES = {400: "bad_request", 413: "too_large", 429: "shed", 503: "no_endpoint"}


class _Stream:
    """One HTTP request's ext_proc stream: what was received, the pick, its release."""

    __slots__ = ("_body", "_limit", "_metrics", "_path", "_picker", "_subset", "pick", "refused")

    def __init__(self, picker: Picker, limit: int, metrics: EppMetrics) -> None:
        self._picker = picker
        self._limit = limit
        self._metrics = metrics
        self._path: str | None = None
        self._subset: frozenset[str] | None = None
        self._body = bytearray()
        self.pick: Pick | None = None
        self.refused = False

    async def receive(self, message: ProcessingRequest) -> list[ProcessingResponse]:
        kind = message.WhichOneof("request")
        if self.refused:
            return []
        if kind == "request_headers":
            return await self._request_headers(message)
        if self._path is None:
            raise ProtocolError(f"{kind} before the request headers")
        if kind == "request_body":
            return await self._request_body(message.request_body.body, message.request_body)
        if kind == "request_trailers":
            return [*await self._routed(end=False), carry_on_trailers(request=True)]
        if kind == "response_headers":
            return self._response_headers(message)
        if kind == "response_body":
            chunk = message.response_body
            if chunk.end_of_stream:
                self.release(True)
            return list(body_pieces(chunk.body, request=False, end=chunk.end_of_stream))
        if kind == "response_trailers":
            self.release(True)
            return [carry_on_trailers(request=False)]
        raise ProtocolError(f"unexpected ext_proc message {kind}")

    async def _request_headers(self, message: ProcessingRequest) -> list[ProcessingResponse]:
        if self._path is not None:
            raise ProtocolError("request headers received twice")
        headers = headers_of(message.request_headers)
        self._path = headers.get(":path", "/")
        self._subset = subset_of(message.metadata_context)
        if message.request_headers.end_of_stream:
            return await self._routed(end=None)
        return []

    async def _request_body(self, chunk: bytes, body: Any) -> list[ProcessingResponse]:
        if self.pick is not None:
            raise ProtocolError("request body after the request was routed")
        self._body += chunk
        if len(self._body) > self._limit:
            return [self._refuse(Refusal(413, f"body over {self._limit} bytes", "too_large"))]
        if not body.end_of_stream:
            return []
        return await self._routed(end=True)

    async def _routed(self, end: bool | None) -> list[ProcessingResponse]:
        """The pick as the request headers' answer, then the body back (`end`: whether it
        ends the request; None: the request has no body)."""
        assert self._path is not None
        body = bytes(self._body)
        self._body = bytearray()
        outcome = await self._picker.pick(self._path, body, self._subset)
        if isinstance(outcome, Refusal):
            return [self._refuse(outcome)]
        self.pick = outcome
        self._metrics.picks.labels("routed").inc()
        removed = () if outcome.headers else _PREFILL_HEADERS
        answers = [route_to(outcome.endpoints, outcome.headers, removed)]
        if end is not None:
            answers += body_pieces(body, request=True, end=end)
        return answers

    def _refuse(self, refusal: Refusal) -> ProcessingResponse:
        self.refused = True
        self._metrics.picks.labels(_OUTCOMES.get(refusal.status, str(refusal.status))).inc()
        return refuse(refusal.status, refusal.message, refusal.code)

    def _response_headers(self, message: ProcessingRequest) -> list[ProcessingResponse]:
        pick = self.pick
        if pick is not None:
            served = served_of(message.metadata_context)
            if served is not None:
                self._picker.served(pick, served)
            status = headers_of(message.response_headers).get(":status", "")
            self._picker.answered(pick, int(status) if status.isdigit() else 502)
            if message.response_headers.end_of_stream:
                self.release(True)
        return [carry_on_response_headers()]

    def release(self, succeeded: bool) -> None:
        if self.pick is not None:
            self._picker.release(self.pick, succeeded)
            self.pick = None


_PREFILL_HEADERS = (PREFILL_HEADER, LLMD_PREFILL_HEADER)
"""Removed from a request sent whole: only the picker names a prefill."""


class ExternalProcessor:
    """The ext_proc service (registered without subclassing the generated servicer)."""

    def __init__(self, picker: Picker, limit: int, metrics: EppMetrics) -> None:
        self._picker = picker
        self._limit = limit
        self._metrics = metrics

    async def Process(
        self, requests: AsyncIterator[ProcessingRequest], context: Any
    ) -> AsyncIterator[ProcessingResponse]:
        stream = _Stream(self._picker, self._limit, self._metrics)
        try:
            async for message in requests:
                try:
                    answers = await stream.receive(message)
                except ProtocolError as exc:
                    self._metrics.streams.inc()
                    log.warning("ext_proc stream aborted: %s", exc)
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                    return
                for answer in answers:
                    yield answer
        finally:
            stream.release(False)


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
            ready = self._picker.ready
            status = serving if ready else health_pb2.HealthCheckResponse.NOT_SERVING
            return health_pb2.HealthCheckResponse(status=status)
        await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {service!r}")

    async def Watch(self, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "use Check")

    async def List(self, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "use Check")


def grpc_server(picker: Picker, limit: int, metrics: EppMetrics) -> Any:
    """A grpc.aio server with both services, not yet bound or started."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", _MESSAGE_BYTES),
            ("grpc.max_send_message_length", _MESSAGE_BYTES),
        ]
    )
    external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(
        ExternalProcessor(picker, limit, metrics), server
    )
    health_pb2_grpc.add_HealthServicer_to_server(Health(picker), server)
    return server
