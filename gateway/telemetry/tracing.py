"""W3C trace context through the gateway, and OpenTelemetry spans of its PD stages.

A request's trace context (`traceparent`, `tracestate`) reaches both workers it is sent to,
so engines that trace join the client's trace:

- tracing off (nothing configured): the client's headers are passed on as they came; the
  gateway is no part of the trace and imports nothing of OpenTelemetry;
- tracing on (`--otlp-traces-endpoint`, or OpenTelemetry's own `OTEL_EXPORTER_OTLP_ENDPOINT`
  / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`; the `otel` extra): the gateway's request span is a
  child of the client's context (a new trace without one), with a child span for the
  route (the index lookup), one per call to a prefill or a decode — whose context is the
  `traceparent` that worker gets — and events for a retry and for the decode's first byte.

Tracing wraps what it traces, installed only when it is on: the handler's request span and
its stages (`gateway.serving.inference`), the legs' calls (`gateway.legs.traced`), both
reading the request's trace from one context variable (`current()`, set for the request's
task), so no signature carries it and a gateway that does not trace runs none of it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Protocol

from globalkv.extras import require

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

TRACE_HEADERS = frozenset({b"traceparent", b"tracestate"})
"""W3C trace context, as the server keeps them from a request's head (lowercase)."""
Headers = tuple[tuple[bytes, bytes], ...]


class CallTrace(Protocol):
    """One call to a worker as the trace sees it."""

    @property
    def headers(self) -> Headers:
        """The trace context the worker is sent."""
        ...

    def event(self, name: str) -> None: ...

    def end(self, status: int | None, error: str | None = None) -> None: ...


_current: ContextVar[TracedRequest | None] = ContextVar("gateway_request_trace", default=None)


def current() -> TracedRequest | None:
    """The trace of the request this task serves; None unless the gateway traces."""
    return _current.get()


def bind(trace: TracedRequest) -> None:
    """Make `trace` the current request's (the handler's task: each request has its own)."""
    _current.set(trace)


class _CallSpan:
    __slots__ = ("_span", "headers")

    def __init__(self, span: Span, headers: Headers) -> None:
        self._span = span
        self.headers = headers

    def event(self, name: str) -> None:
        self._span.add_event(name)

    def end(self, status: int | None, error: str | None = None) -> None:
        from opentelemetry.trace import Status, StatusCode

        if status is not None:
            self._span.set_attribute("http.response.status_code", status)
        if error is not None or status is None or status >= 500:
            self._span.set_status(Status(StatusCode.ERROR, error))
        self._span.end()


class TracedRequest:
    """A request's spans: its own, and its stages' as children."""

    __slots__ = ("_span", "_tracer")

    def __init__(self, tracer: Tracer, span: Span) -> None:
        self._tracer = tracer
        self._span = span

    def stage(self, name: str) -> Span:
        """A child span for a stage of the gateway's own (ended by the caller)."""
        from opentelemetry import trace

        return self._tracer.start_span(name, context=trace.set_span_in_context(self._span))

    def call(self, role: str, worker: str) -> CallTrace:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        span = self._tracer.start_span(
            role,
            context=trace.set_span_in_context(self._span),
            kind=trace.SpanKind.CLIENT,
            attributes={"globalkv.role": role, "globalkv.worker": worker},
        )
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier, trace.set_span_in_context(span))
        headers = tuple((k.encode(), v.encode()) for k, v in carrier.items())
        return _CallSpan(span, headers)

    def event(self, name: str, attributes: Mapping[str, str | int]) -> None:
        self._span.add_event(name, dict(attributes))

    def end(self, status: int) -> None:
        from opentelemetry.trace import Status, StatusCode

        self._span.set_attribute("http.response.status_code", status)
        if status >= 500:
            self._span.set_status(Status(StatusCode.ERROR))
        self._span.end()


class Tracing:
    """Spans of the gateway's requests, made by `provider`'s tracer."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self._tracer = provider.get_tracer("globalkv.gateway")

    def begin(self, path: str, headers: Sequence[tuple[bytes, bytes]]) -> TracedRequest:
        """The span of a request to `path`, a child of the trace context in `headers`."""
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier = {name.decode(): value.decode("latin-1") for name, value in headers}
        parent = TraceContextTextMapPropagator().extract(carrier)
        span = self._tracer.start_span(
            f"POST {path}",
            context=parent,
            kind=trace.SpanKind.SERVER,
            attributes={"http.request.method": "POST", "http.route": path},
        )
        return TracedRequest(self._tracer, span)

    def shutdown(self) -> None:
        """Export what is still buffered."""
        self.provider.shutdown()


def otlp_tracing(endpoint: str, flag_given: bool) -> Tracing:
    """Tracing exported by OTLP over HTTP (JSON-encoded, which every OTLP/HTTP receiver
    takes), in batches off the request path. The flag's
    endpoint is the full URL of the traces path; OpenTelemetry's variables are read by its
    exporter as OpenTelemetry documents them (OTEL_EXPORTER_OTLP_ENDPOINT gets /v1/traces)."""
    require("the gateway's OpenTelemetry traces", "otel", "opentelemetry.sdk")
    from opentelemetry.exporter.otlp.json.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    name = os.environ.get("OTEL_SERVICE_NAME", "globalkv-gateway")
    resource = Resource.create({"service.name": name})
    provider = TracerProvider(resource=resource)
    exporter = OTLPSpanExporter(endpoint=endpoint) if flag_given else OTLPSpanExporter()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return Tracing(provider)
