"""One inference request, from its body to its answer: the handler of the gateway's server.

The server (`gateway.http.server`) reads the request and writes the answer; everything in
between is here: the API key, the request's way in (`gateway.serving.intake`, the
picker's too: read, looked up in the index, admitted by flow control or admission
control), the dispatcher, and the request metrics (count by status, time to first byte,
duration). Reading the body within `--max-payload-size` is the server's part (it can
refuse before reading); it reports a refusal through `refused` so that it is counted like
any other answer. Request ids and CORS (`gateway.serving.edge`) are on every answer.

A client that goes away is the server's to notice: it cancels `handle` (counted as 499)
or, once a stream is under way, closes the stream as `client_gone`, which cancels a
prefill still running.

Error bodies, one shape per API family (`docs/operations.md`, "Error answers"): the
gateway's own refusals are OpenAI's error object on every endpoint
(`gateway.http.answer.error_body`). A worker's error answer is passed on as it is on
SGLang's `/generate`; on the OpenAI endpoints one in another shape — SGLang's and older
vLLM's flat `{"object": "error", "message", …}`, FastAPI's `{"detail": …}`, plain text —
is rewritten into OpenAI's, its fields kept, so that a client reads one shape whoever
refused it.

A request the gateway can serve without awaiting anything before its first attempt but
the index's answer (no flow control, a place free at once under admission control, not
traced, a body read inline, the gateway's own connection pool) is answered by callbacks
instead of a task (`begin`,
`gateway.serving.relay`): the same reading, metrics, ids and error bodies as `handle`,
through the methods here; the rest of it goes through `handle`.

One path serves every request. Without tracing the client's W3C trace context goes to the
workers as it came (`Incoming.trace_context`); with tracing (`gateway.telemetry.tracing`)
the request's span is begun around that path and the lookups and the wait in a queue are
stages of it, each wrapped once when the handler is made (`Intake`), so a gateway that
does not trace runs no tracing code per request; the calls' spans are the legs'
(`gateway.legs.traced`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from functools import partial
from typing import Any

import orjson

from gateway.http.answer import After, Answer, Outcome, problem
from gateway.http.exchange import RelayWire
from gateway.http.wire import HttpRequest
from gateway.legs.deadline import Progress
from gateway.legs.dispatch import Begun
from gateway.requests.headers import Picked
from gateway.requests.request import Request
from gateway.serving.edge import Edge, Headers
from gateway.serving.intake import UNREADABLE, Intake, Place, refusal
from gateway.serving.reading import INFERENCE_PATHS
from gateway.serving.relay import Relay
from gateway.serving.service import Gateway
from gateway.telemetry.metrics import EndpointMetrics
from gateway.telemetry.tracing import TRACE_HEADERS, Tracing, bind
from kvplumbing.auth import bearer_matches
from kvplumbing.budget import BodyBudget

_TRACE_ORDER = (b"traceparent", b"tracestate")


def openai_error(answer: Answer) -> Answer:
    """`answer`, an error, with OpenAI's error object as its body (its fields kept)."""
    try:
        body: Any = orjson.loads(answer.body)
    except orjson.JSONDecodeError:
        body = answer.body.decode("utf-8", "replace")
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        error = body["error"]
    elif isinstance(body, dict) and body.get("object") == "error":
        error = {key: value for key, value in body.items() if key != "object"}
    else:
        detail = body.get("detail", body) if isinstance(body, dict) else body
        message = detail if isinstance(detail, str) else orjson.dumps(detail).decode()
        error = {"message": message, "type": "upstream_error"}
    shaped = {"message": "", "type": "upstream_error", "param": None, "code": None, **error}
    if shaped == error and body == {"error": error}:
        return answer
    return Answer(answer.status, orjson.dumps({"error": shaped}), headers=answer.headers)


# Built per request: its own __init__, compiled where the module is (the dataclass gives
# eq and repr only; its generated __init__ runs interpreted): docs/gateway-design.md.
@dataclass(slots=True, init=False)
class Incoming:
    """The request being served, as the handler read it once, from `handle` down."""

    path: str
    body: bytes
    headers: Headers
    """All of them, names in lowercase (a traced request's span reads its parent there)."""
    picked: Picked
    """Those read here, by name: one pass over the headers for all."""
    authorization: str | None
    request_id: str
    """The client's request id, or one made (`gateway.serving.edge`)."""
    trace_context: Headers
    """The client's W3C trace context, passed on to the workers as it came; none when the
    gateway traces (each call then carries its own span's)."""

    def __init__(
        self,
        path: str,
        body: bytes,
        headers: Headers,
        picked: Picked,
        authorization: str | None,
        request_id: str,
        trace_context: Headers,
    ) -> None:
        self.path = path
        self.body = body
        self.headers = headers
        self.picked = picked
        self.authorization = authorization
        self.request_id = request_id
        self.trace_context = trace_context


class Inference:
    """The handler of the gateway's (and a sidecar's) inference paths.

    `named_prefill`: requests are bound to the prefill their picker named (a decode's
    sidecar: `gateway.requests.headers`)."""

    def __init__(self, gateway: Gateway, *, named_prefill: bool = False) -> None:
        self._gateway = gateway
        config = gateway.config
        self.edge = Edge(config.edge)
        tracing = gateway.tracing
        self.intake = Intake(gateway, named_prefill=named_prefill, traced=tracing is not None)
        self._picked = frozenset(
            {*self.edge.header_names, *self.intake.reader.header_names, *TRACE_HEADERS, b"origin"}
        )
        """The request headers read here: request ids, what the reader reads (sessions, the
        named prefill, flow control's), trace context and origin."""
        self._metrics = {
            path: EndpointMetrics(gateway.metrics, endpoint)
            for path, endpoint in INFERENCE_PATHS.items()
        }
        self._passes_trace = tracing is None
        """The client's trace context goes to the workers as it came: the gateway does not
        trace (a traced request's calls carry their own span's)."""
        self._answer: Callable[[Incoming], Awaitable[Answer]] = self._serve
        if tracing is not None:
            self._answer = _traced(tracing, self._serve)
        self._relays = tracing is None and self.intake.admits_now and gateway.calls.relays
        """Requests may be answered by callbacks (`begin`)."""

    @property
    def paths(self) -> Collection[str]:
        return INFERENCE_PATHS.keys()

    @property
    def limit(self) -> int:
        return self._gateway.config.max_payload_size

    @property
    def budget(self) -> BodyBudget:
        """The bytes of every request's body held at once (the gateway's)."""
        return self._gateway.bodies

    def refused(self, path: str, answer: Answer) -> None:
        """An answer given without calling a worker (401, 400, 413), counted."""
        self._metrics[path].answered(answer.status)

    async def handle(
        self, path: str, authorization: str | None, body: bytes, headers: Headers = ()
    ) -> Answer:
        # One pass over the headers for every one read here (a repeated one by its last).
        picked = {name: value for name, value in headers if name in self._picked}
        request_id = self.edge.request_id(path, picked)
        trace_context = self._trace_context(picked)
        incoming = Incoming(path, body, headers, picked, authorization, request_id, trace_context)
        answer = await self._answer(incoming)
        return self.headed(answer, request_id, picked.get(b"origin"))

    def begin(self, request: HttpRequest, wire: RelayWire) -> Relay | None:
        """The relay that answers `request` (a complete POST to one of `paths`) by
        callbacks on `wire`, once started, when it needs nothing awaited before its first
        attempt but the index's answer; None where `handle` is to answer it instead (every
        refusal included)."""
        if not self._relays or request.route is None or request.version != "1.1":
            return None
        started = self._gateway.clock()
        path = request.route
        picked = {name: value for name, value in request.headers if name in self._picked}
        raw = request.authorization
        authorization = None if raw is None else raw.decode("latin-1")
        if not bearer_matches(authorization, self._gateway.config.api_key):
            return None
        request_id = self.edge.request_id(path, picked)
        body = request.body[0] if len(request.body) == 1 else b"".join(request.body)
        try:
            admitted = self.intake.admit_now(
                path, body, picked, authorization, request_id, self._trace_context(picked)
            )
        except UNREADABLE:
            return None
        if admitted is None:
            return None
        request.body.clear()  # held once, not twice, while it is served
        read, place = admitted
        gateway = self._gateway
        return Relay(
            self,
            gateway.dispatcher,
            wire,
            request,
            read,
            self._metrics[path],
            gateway.clock,
            started,
            request_id,
            picked.get(b"origin"),
            self.intake.look_up if self.intake.looks_up else None,
            place,
        )

    def _trace_context(self, picked: Picked) -> Headers:
        """The client's W3C trace context, passed on as it came when the gateway does not
        trace."""
        if self._passes_trace and picked and not TRACE_HEADERS.isdisjoint(picked):
            return tuple((n, picked[n]) for n in _TRACE_ORDER if n in picked)
        return ()

    def headed(self, answer: Answer, request_id: str, origin: bytes | None) -> Answer:
        """`answer` with the head lines every inference answer gets (`Edge`)."""
        own = self.edge.answer_headers(request_id, origin)
        if answer.headers:
            own = (*(h for h in answer.headers if h[0] != "x-request-id"), *own)
        answer.headers = own
        return answer

    async def _serve(self, incoming: Incoming) -> Answer:
        """The answer once the API key is right and the request admitted (`Intake`); the
        place it holds is given back once the answer is over (a stream's when it closes),
        whatever happens."""
        if not bearer_matches(incoming.authorization, self._gateway.config.api_key):
            message = "missing or wrong API key (Authorization: Bearer …)"
            return self._refuse(incoming.path, problem(401, message, "auth_error"))
        gateway = self._gateway
        path = incoming.path
        metrics = self._metrics[path]
        started = gateway.clock()
        try:
            admitted = await self.intake.admit(
                path,
                incoming.body,
                incoming.picked,
                incoming.authorization,
                request_id=incoming.request_id,
                trace_context=incoming.trace_context,
            )
        except asyncio.CancelledError:
            self.gone(metrics, started)
            raise
        if isinstance(admitted, Answer):
            return self._refuse(path, admitted)
        assert admitted.request is not None, "an inference path"
        try:
            return await self.forwarded(admitted.request, metrics, started, admitted.place)
        except UNREADABLE as exc:  # the first attempt's BadRequest
            return self._refuse(path, refusal(exc), admitted.place)

    async def forwarded(
        self,
        request: Request,
        metrics: EndpointMetrics,
        started: float,
        place: Place | None = None,
        progress: Progress | None = None,
        first: Begun | None = None,
    ) -> Answer:
        """The dispatcher's answer to `request`, measured (`place`: what it holds; the
        rest: `Dispatcher.forward`'s); a client that leaves is counted 499. Raises what
        `UNREADABLE` names (the first attempt's BadRequest), `place` then still held."""
        gateway = self._gateway
        try:
            answer = await gateway.dispatcher.forward(request, progress, first)
        except UNREADABLE:
            raise
        except asyncio.CancelledError:
            if place is not None:
                place.release()
            self.gone(metrics, started)
            raise
        except BaseException:
            if place is not None:
                place.release()
            raise
        if answer.rest is not None:
            metrics.ttfb.observe(gateway.clock() - started)
            if place is not None:
                place.started()
            ended = partial(self.stream_ended, metrics, started, answer.status, place)
            answer.rest = After(answer.rest, ended)
            return answer
        if place is not None:
            place.release()
        return self.whole(request.path, metrics, started, answer)

    def whole(self, path: str, metrics: EndpointMetrics, started: float, answer: Answer) -> Answer:
        """A whole answer `shaped` and `measured`."""
        answer = self.shaped(path, answer)
        self.measured(metrics, started, answer.status)
        return answer

    @staticmethod
    def shaped(path: str, answer: Answer) -> Answer:
        """A whole answer as the client gets it: an error in OpenAI's shape on the OpenAI
        paths."""
        if answer.status >= 400 and path != "/generate":
            return openai_error(answer)
        return answer

    def measured(self, metrics: EndpointMetrics, started: float, status: int) -> None:
        """A whole answer measured: the time to it (first byte and all) and its status."""
        elapsed = self._gateway.clock() - started
        metrics.ttfb.observe(elapsed)
        metrics.latency.observe(elapsed)
        metrics.answered(status)

    def gone(self, metrics: EndpointMetrics, started: float) -> None:
        """The client left before its answer: counted 499."""
        metrics.ttfb.observe(self._gateway.clock() - started)
        metrics.answered(499)

    def stream_ended(
        self,
        metrics: EndpointMetrics,
        started: float,
        status: int,
        place: Place | None,
        outcome: Outcome,
    ) -> None:
        """A stream's request is over: measured (duration, status), its place given back
        (`place`, when it holds one)."""
        metrics.latency.observe(self._gateway.clock() - started)
        metrics.answered(status)
        if place is not None:
            place.release()

    def _refuse(self, path: str, answer: Answer, place: Place | None = None) -> Answer:
        """`answer`, a refusal, counted; the place the request held given back."""
        if place is not None:
            place.release()
        self.refused(path, answer)
        return answer


def _traced(
    tracing: Tracing, respond: Callable[[Incoming], Awaitable[Answer]]
) -> Callable[[Incoming], Awaitable[Answer]]:
    """`respond` in the request's span: a child of the client's trace context (which then
    goes to no worker: each call carries its own span's), ended with the answer (a
    stream's when it closes), 499 when the client left first."""

    async def in_span(incoming: Incoming) -> Answer:
        traced = tracing.begin(incoming.path, incoming.headers)
        bind(traced)
        try:
            answer = await respond(incoming)
        except BaseException:
            traced.end(499)
            raise
        if answer.rest is None:
            traced.end(answer.status)
        else:
            status = answer.status
            answer.rest = After(answer.rest, lambda _: traced.end(status))
        return answer

    return in_span
