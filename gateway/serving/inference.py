"""One inference request, from its body to its answer: the handler of the gateway's server.

The server (`gateway.http.server`) reads the request and writes the answer; everything in
between is here: the API key, the body checks (400 with the reason), tokens, the route
(`Router.look_up`: one index lookup), the dispatcher, and the request metrics (count by
status, time to first byte, duration). Reading the body within `--max-payload-size` is the
server's part (it can refuse before reading); it reports a refusal through `refused` so
that it is counted like any other answer. Admission control (`gateway.flow.admission`) comes
after the API key and before everything else; request ids and CORS (`gateway.serving.edge`) are
on every answer.

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

A prompt to tokenize in a body over `TOKENIZE_INLINE_MAX` bytes is tokenized in a worker
thread: a long text held the event loop, and every other request with it, for as long as
its tokenizer ran (Hugging Face's releases the GIL). Shorter ones are tokenized inline,
where a thread would cost more than the work.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection
from typing import Any

import orjson

from gateway.flow.admission import Admission
from gateway.flow.control import FlowControl, Grant
from gateway.flow.queues import FlowRequest
from gateway.http.answer import Answer, Outcome, Rest, problem
from gateway.policies.base import RouteQuery
from gateway.requests.bodies import (
    BadRequest,
    Endpoint,
    ParsedRequest,
    PromptTokens,
    decode_body,
    parse_request,
    prompt_tokens,
)
from gateway.requests.namespace import UnknownAdapter
from gateway.serving.edge import Edge, Headers, Picked
from gateway.serving.service import Gateway
from gateway.telemetry.metrics import EndpointMetrics
from gateway.telemetry.tracing import (
    TRACE_HEADERS,
    TracedRequest,
    Tracing,
    bind,
    passed_on,
    trace_headers,
)
from globalkv.tokenize import TokenizeError
from kvplumbing.auth import bearer_matches
from kvplumbing.budget import BodyBudget
from kvplumbing.clock import Clock

TOKENIZE_INLINE_MAX = 64 * 1024
SESSION_HEADERS = (b"x-smg-routing-key", b"x-dynamo-session-id")
"""Where a client names its conversation (`gateway.policies.sessions`): smg's header, then
Dynamo's."""
MAX_SESSION_BYTES = 256
INFERENCE_PATHS: dict[str, Endpoint] = {
    "/generate": "generate",
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
}


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


class _Measured:
    """A stream's rest whose request is measured (duration, status) when it closes."""

    __slots__ = ("_clock", "_metrics", "_rest", "_started", "_status", "ended", "traced")

    def __init__(
        self, rest: Rest, status: int, metrics: EndpointMetrics, started: float, clock: Clock
    ) -> None:
        self._rest = rest
        self._status = status
        self._metrics = metrics
        self._started = started
        self._clock = clock
        self.traced: TracedRequest | None = None
        self.ended: Callable[[], None] | None = None
        """Told once the stream is over (admission's place given back)."""

    def next(self) -> Awaitable[bytes]:
        return self._rest.next()

    async def close(self, outcome: Outcome) -> None:
        try:
            await self._rest.close(outcome)
        finally:
            self._metrics.latency.observe(self._clock() - self._started)
            self._metrics.answered(self._status)
            if self.traced is not None:
                self.traced.end(self._status)
            if self.ended is not None:
                self.ended()


PrefillNamed = Callable[[Headers], str | None]
"""The prefill a request's headers name (`RouteQuery.prefill`), or None; raises
`BadRequest` for a header that names none well."""


class Inference:
    def __init__(self, gateway: Gateway, named_prefill: PrefillNamed | None = None) -> None:
        self._gateway = gateway
        self._named_prefill = named_prefill
        config = gateway.config
        self.edge = Edge(config.edge)
        self._flow = gateway.flow
        flow_headers = self._flow.keys.header_names if self._flow is not None else ()
        self._picked = frozenset(
            {*self.edge.header_names, *SESSION_HEADERS, *TRACE_HEADERS, b"origin", *flow_headers}
        )
        """The request headers read here: request ids, sessions, trace context, origin, and
        flow control's."""
        self._admission = (
            Admission(config.admission, gateway.clock, gateway.metrics.registry)
            if config.admission.max_concurrent_requests > 0 and self._flow is None
            else None
        )
        self._metrics = {
            path: EndpointMetrics(gateway.metrics, endpoint)
            for path, endpoint in INFERENCE_PATHS.items()
        }

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
        tracing = self._gateway.tracing
        if tracing is None:  # the client's trace context passed on to the workers as it came
            if picked and not TRACE_HEADERS.isdisjoint(picked):
                bind(passed_on(trace_headers(headers)))
            answer = await self._admitted(
                path, authorization, body, request_id, None, headers, picked
            )
        else:
            answer = await self._traced(
                tracing, path, authorization, body, request_id, headers, picked
            )
        own = self.edge.answer_headers(request_id, picked.get(b"origin"))
        if answer.headers:
            own = (*(h for h in answer.headers if h[0] != "x-request-id"), *own)
        answer.headers = own
        return answer

    async def _traced(
        self,
        tracing: Tracing,
        path: str,
        authorization: str | None,
        body: bytes,
        request_id: str,
        headers: Headers,
        picked: Picked,
    ) -> Answer:
        """The answer in the request's span."""
        traced = tracing.begin(path, headers)
        bind(traced)
        try:
            answer = await self._admitted(
                path, authorization, body, request_id, traced, headers, picked
            )
        except BaseException:
            traced.end(499)
            raise
        if isinstance(answer.rest, _Measured):
            answer.rest.traced = traced  # ended with the stream
        else:
            traced.end(answer.status)
        return answer

    async def _admitted(
        self,
        path: str,
        authorization: str | None,
        body: bytes,
        request_id: str,
        traced: TracedRequest | None,
        headers: Headers,
        picked: Picked,
    ) -> Answer:
        """The answer once the API key is right and admission control let the request in
        (its place given back once the answer is over: a stream's when it closes)."""
        gateway = self._gateway
        if not bearer_matches(authorization, gateway.config.api_key):
            message = "missing or wrong API key (Authorization: Bearer …)"
            return self._refuse(path, problem(401, message, "auth_error"))
        admission = self._admission
        if admission is None:
            return await self._serve(path, body, request_id, traced, headers, picked, authorization)
        refusal = await admission.admit()
        if refusal is not None:
            return self._refuse(path, refusal)
        try:
            answer = await self._serve(
                path, body, request_id, traced, headers, picked, authorization
            )
        except BaseException:
            admission.release()
            raise
        if isinstance(answer.rest, _Measured):
            answer.rest.ended = admission.release
        else:
            admission.release()
        return answer

    async def _serve(
        self,
        path: str,
        body: bytes,
        request_id: str,
        traced: TracedRequest | None,
        headers: Headers,
        picked: Picked,
        authorization: str | None = None,
    ) -> Answer:
        gateway = self._gateway
        metrics = self._metrics[path]
        grant: Grant | None = None
        started = gateway.clock()
        router = gateway.router
        try:
            named = None if self._named_prefill is None else self._named_prefill(headers)
            parsed = parse_request(INFERENCE_PATHS[path], decode_body(body))
            parsed.request_id = request_id
            namespace = router.namespace(parsed.body)
            session = _session(picked) if picked else None
            if len(body) > TOKENIZE_INLINE_MAX and parsed.token_ids is None:
                tokens = await asyncio.to_thread(prompt_tokens, parsed, gateway.tokenizer)
            else:
                tokens = prompt_tokens(parsed, gateway.tokenizer)
            kind = "sglang" if parsed.endpoint == "generate" else namespace.kind
            query = RouteQuery(
                tokens.tokens,
                tokens.text,
                prefill=named,
                session=session,
                missing=tokens.missing,
                namespace=namespace,
                kind=kind,
                batch=parsed.batch,
            )
            if traced is None:
                await router.look_up(query)
            else:
                span = traced.stage("route")
                try:
                    await router.look_up(query)
                finally:
                    span.end()
            if self._flow is not None:
                entered = await self._enter(
                    self._flow,
                    parsed,
                    tokens,
                    query,
                    picked,
                    authorization,
                    len(body),
                    traced,
                )
                if isinstance(entered, Answer):
                    return self._refuse(path, entered)
                grant = entered
                if grant.waited:  # placed on what the index shows now
                    await router.look_up(query)
                grant.sent()  # its load is tracked from here on, before any await
            answer = await gateway.dispatcher.forward(parsed, query, path)
        except (BadRequest, TokenizeError) as exc:  # BadRequest also from the first attempt
            return self._refuse(path, problem(400, str(exc)))
        except UnknownAdapter as exc:
            return self._refuse(path, problem(404, str(exc), "NotFoundError"))
        except asyncio.CancelledError:
            if grant is not None:
                grant.release()
            metrics.ttfb.observe(gateway.clock() - started)
            metrics.answered(499)
            raise
        except BaseException:
            if grant is not None:
                grant.release()
            raise
        now = gateway.clock()
        metrics.ttfb.observe(now - started)
        if answer.status >= 400 and answer.rest is None and path != "/generate":
            answer = openai_error(answer)
        if answer.rest is not None:
            answer.rest = _Measured(answer.rest, answer.status, metrics, started, gateway.clock)
            if grant is not None:
                grant.started()
                answer.rest.ended = grant.release
            return answer
        if grant is not None:
            grant.release()
        metrics.latency.observe(now - started)
        metrics.answered(answer.status)
        return answer

    async def _enter(
        self,
        flow: FlowControl,
        parsed: ParsedRequest,
        tokens: PromptTokens,
        query: RouteQuery,
        picked: Picked,
        authorization: str | None,
        size: int,
        traced: TracedRequest | None,
    ) -> Grant | Answer:
        """The request's turn in the flow queues, or the refusal to answer."""
        key = flow.keys.read(picked, query.namespace.lora_name, authorization)
        if tokens.tokens is not None:
            count = len(tokens.tokens)
        else:  # no tokenizer: about four bytes a token
            count = max(1, len(tokens.text or "") // 4 or size // 4)
        request = FlowRequest(key, count, size, query)
        if traced is None:
            return await flow.enter(request)
        span = traced.stage("queue")
        try:
            return await flow.enter(request)
        finally:
            span.end()

    def _refuse(self, path: str, answer: Answer) -> Answer:
        self.refused(path, answer)
        return answer


def _session(picked: Picked) -> str | None:
    """The conversation the client named, by the first of `SESSION_HEADERS` it sent."""
    for name in SESSION_HEADERS:
        value = picked.get(name)
        if not value:
            continue
        if len(value) > MAX_SESSION_BYTES:
            raise BadRequest(f"{name.decode()} is longer than {MAX_SESSION_BYTES} bytes")
        return value.decode("latin-1")
    return None
