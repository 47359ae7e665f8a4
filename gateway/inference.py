"""One inference request, from its body to its answer: the handler of the gateway's server.

The server (`gateway.http.server`) reads the request and writes the answer; everything in
between is here: the API key, the body checks (400 with the reason), tokens, the route
(`Router.route`: one index lookup), the dispatcher, and the request metrics (count by
status, time to first byte, duration). Reading the body within `--max-payload-size` is the
server's part (it can refuse before reading); it reports a refusal through `refused` so
that it is counted like any other answer.

A client that goes away is the server's to notice: it cancels `handle` (counted as 499)
or, once a stream is under way, closes the stream as `client_gone`, which cancels a
prefill still running.

A prompt to tokenize in a body over `TOKENIZE_INLINE_MAX` bytes is tokenized in a worker
thread: a long text held the event loop, and every other request with it, for as long as
its tokenizer ran (Hugging Face's releases the GIL). Shorter ones are tokenized inline,
where a thread would cost more than the work.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Collection, Sequence

from gateway.http.answer import Answer, Outcome, Rest, problem
from gateway.metrics import EndpointMetrics
from gateway.requests import (
    BadRequest,
    Endpoint,
    UnknownAdapter,
    decode_body,
    parse_request,
    prompt_tokens,
)
from gateway.service import Gateway
from globalkv.tokenize import TokenizeError
from kvplumbing.auth import bearer_matches
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


class _Measured:
    """A stream's rest whose request is measured (duration, status) when it closes."""

    __slots__ = ("_clock", "_metrics", "_rest", "_started", "_status")

    def __init__(
        self, rest: Rest, status: int, metrics: EndpointMetrics, started: float, clock: Clock
    ) -> None:
        self._rest = rest
        self._status = status
        self._metrics = metrics
        self._started = started
        self._clock = clock

    def next(self) -> Awaitable[bytes]:
        return self._rest.next()

    async def close(self, outcome: Outcome) -> None:
        try:
            await self._rest.close(outcome)
        finally:
            self._metrics.latency.observe(self._clock() - self._started)
            self._metrics.answered(self._status)


class Inference:
    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway
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

    def refused(self, path: str, answer: Answer) -> None:
        """An answer given without calling a worker (401, 400, 413), counted."""
        self._metrics[path].answered(answer.status)

    async def handle(
        self,
        path: str,
        authorization: str | None,
        body: bytes,
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> Answer:
        gateway = self._gateway
        metrics = self._metrics[path]
        started = gateway.clock()
        if not bearer_matches(authorization, gateway.config.api_key):
            message = "missing or wrong API key (Authorization: Bearer …)"
            return self._refuse(path, problem(401, message, "auth_error"))
        router = gateway.router
        try:
            parsed = parse_request(INFERENCE_PATHS[path], decode_body(body))
            parsed.namespace = router.namespace(parsed.body)
            session = _session(headers)
            if len(body) > TOKENIZE_INLINE_MAX and parsed.token_ids is None:
                tokens = await asyncio.to_thread(prompt_tokens, parsed, gateway.tokenizer)
            else:
                tokens = prompt_tokens(parsed, gateway.tokenizer)
            route = await router.route(tokens, parsed.namespace, session)
            answer = await gateway.dispatcher.forward(parsed, route, path)
        except (BadRequest, TokenizeError) as exc:  # BadRequest also from the first attempt
            return self._refuse(path, problem(400, str(exc)))
        except UnknownAdapter as exc:
            return self._refuse(path, problem(404, str(exc), "NotFoundError"))
        except asyncio.CancelledError:
            metrics.ttfb.observe(gateway.clock() - started)
            metrics.answered(499)
            raise
        now = gateway.clock()
        metrics.ttfb.observe(now - started)
        if answer.rest is not None:
            answer.rest = _Measured(answer.rest, answer.status, metrics, started, gateway.clock)
            return answer
        metrics.latency.observe(now - started)
        metrics.answered(answer.status)
        return answer

    def _refuse(self, path: str, answer: Answer) -> Answer:
        self.refused(path, answer)
        return answer


def _session(headers: Sequence[tuple[bytes, bytes]]) -> str | None:
    """The conversation the client named, by the first of `SESSION_HEADERS` it sent."""
    named = dict((name, value) for name, value in headers if name in SESSION_HEADERS)
    for name in SESSION_HEADERS:
        value = named.get(name)
        if not value:
            continue
        if len(value) > MAX_SESSION_BYTES:
            raise BadRequest(f"{name.decode()} is longer than {MAX_SESSION_BYTES} bytes")
        return value.decode("latin-1")
    return None
