"""One inference request, from its body to its answer, apart from the HTTP that carries it.

The server (`gateway.http.server`, through `gateway.http.exchange`) reads the request and writes the
answer; everything in between is here: the API key, the body
checks (400 with the reason), tokens, one index lookup, the dispatcher, and the request
metrics (count by status, time to first byte, duration). Reading the body within
`--max-payload-size` is the server's part (it can refuse before reading); it reports a
refusal through `refuse` so that it is counted like any other answer.

A client that goes away is the server's to notice: it cancels `handle` (counted as 499)
or, once a stream is committed, `Relay.run`, which then cancels a prefill still running.

A prompt to tokenize in a body over `TOKENIZE_INLINE_MAX` bytes is tokenized in a worker
thread: a long text took the event loop, and every other request with it, for as long as
its tokenizer ran (Hugging Face's releases the GIL). Shorter ones are tokenized inline,
where a thread would cost more than the work.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from gateway.http.answer import Answer, problem
from gateway.legs.dispatch import Stream
from gateway.legs.sglang import Endpoint
from gateway.metrics import EndpointMetrics
from gateway.policies.base import RouteRequest
from gateway.requests import BadRequest, decode_body, parse_request, prompt_tokens
from gateway.service import Gateway
from globalkv.tokenize import TokenizeError
from kvplumbing.auth import bearer_matches
from kvplumbing.clock import Clock

TOKENIZE_INLINE_MAX = 64 * 1024
INFERENCE_PATHS: dict[str, Endpoint] = {
    "/generate": "generate",
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
}


@dataclass(slots=True)
class Relay:
    """A committed stream: the server sends `status`, `headers` and `first`, then `run`."""

    status: int
    headers: dict[str, str]
    first: bytes
    _stream: Stream
    _metrics: EndpointMetrics
    _started: float
    _clock: Clock

    async def run(self, send: Callable[[bytes], Awaitable[None]]) -> bool:
        """Pass the rest on as it arrives; True when the decode's stream ended properly.

        Cancelled (the client went away) or ended by an error of `send`, the stream is
        closed as `client_gone`; an upstream error mid-stream closes it as such.
        """
        outcome = "client_gone"
        try:
            async for chunk in self._stream.rest:
                await send(chunk)
            outcome = "done"
        except httpx.HTTPError:
            outcome = "upstream_error"
        finally:
            await self._stream.close(outcome)
            self._metrics.latency.observe(self._clock() - self._started)
            self._metrics.answered(self.status)
        return outcome == "done"

    async def abandon(self) -> None:
        """The client left before anything was sent."""
        await self._stream.close("client_gone")
        self._metrics.answered(499)


class Inference:
    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway
        self._metrics = {
            endpoint: EndpointMetrics(gateway.metrics, endpoint)
            for endpoint in INFERENCE_PATHS.values()
        }

    @property
    def max_payload_size(self) -> int:
        return self._gateway.config.max_payload_size

    def refuse(self, endpoint: Endpoint, answer: Answer) -> Answer:
        """An answer given without calling a worker (401, 400, 413), counted."""
        self._metrics[endpoint].answered(answer.status)
        return answer

    async def handle(
        self, endpoint: Endpoint, path: str, authorization: str | None, raw: bytes
    ) -> Answer | Relay:
        gateway = self._gateway
        metrics = self._metrics[endpoint]
        started = gateway.clock()
        if not bearer_matches(authorization, gateway.config.api_key):
            message = "missing or wrong API key (Authorization: Bearer …)"
            return self.refuse(endpoint, problem(401, message, "auth_error"))
        router = gateway.router
        try:
            parsed = parse_request(endpoint, decode_body(raw))
            if len(raw) > TOKENIZE_INLINE_MAX and parsed.token_ids is None:
                tokens = await asyncio.to_thread(prompt_tokens, parsed, gateway.tokenizer)
            else:
                tokens = prompt_tokens(parsed, gateway.tokenizer)
            lookup = None
            if router.uses_index:
                lookup = await router.lookup(tokens.tokens, tokens.missing, parsed.model)
            route = RouteRequest(tokens.tokens, tokens.text, lookup, now=gateway.clock())
            outcome = await gateway.dispatcher.forward(parsed, route, path)
        except (BadRequest, TokenizeError) as exc:  # BadRequest also from the first attempt
            return self.refuse(endpoint, problem(400, str(exc)))
        except asyncio.CancelledError:
            metrics.ttfb.observe(gateway.clock() - started)
            metrics.answered(499)
            raise
        now = gateway.clock()
        metrics.ttfb.observe(now - started)
        if isinstance(outcome, Stream):
            return Relay(
                outcome.status,
                outcome.headers,
                outcome.first,
                outcome,
                metrics,
                started,
                gateway.clock,
            )
        metrics.latency.observe(now - started)
        metrics.answered(outcome.status)
        return outcome
