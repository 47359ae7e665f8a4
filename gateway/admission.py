"""Admission control with sglang-router's semantics (`--max-concurrent-requests`,
`--queue-size`, `--queue-timeout-secs`, `--rate-limit-tokens-per-second`).

A token bucket holds up to `max_concurrent_requests` tokens and refills at
`rate_limit_tokens_per_second` (by default the same number per second). A request takes
one token to be served and gives it back once its answer is handed over (a stream's: at
its first byte, as sglang-router's middleware does), so the bucket bounds both the
requests in flight and, through the refill, how fast new ones start. A request finding no
token waits in a queue of at most `queue_size`; a full queue (or none, `queue_size` 0) is
answered 429 at once and a wait past `queue_timeout_secs` 408, as sglang-router answers.

Unlike sglang-router, whose queued requests race for each token, the queue here is FIFO:
a token freed or refilled goes to the request that has waited longest, so no request can
be overtaken indefinitely. Each refusal carries an OpenAI-style error body saying which
limit it met, and the 429 a `Retry-After` header.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.config import AdmissionConfig
from gateway.http.answer import Answer, error_body
from kvplumbing.clock import Clock


class Admission:
    """One gateway's bucket and queue; `admit` before serving, `release` after."""

    def __init__(self, config: AdmissionConfig, clock: Clock, registry: CollectorRegistry) -> None:
        assert config.max_concurrent_requests > 0, "build only with a limit"
        self._config = config
        self._clock = clock
        self._capacity = float(config.max_concurrent_requests)
        self._rate = config.rate_limit_tokens_per_second or self._capacity
        self._tokens = self._capacity
        self._refilled = clock()
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self.refused = Counter(
            "globalkv_gateway_admission_refused",
            "Requests refused by admission control, by reason (queue_full: 429, "
            "queue_timeout: 408).",
            ["reason"],
            registry=registry,
        )
        self.queued = Gauge(
            "globalkv_gateway_admission_queued",
            "Requests waiting in the admission queue for a token.",
            registry=registry,
        )
        self.queued.set_function(lambda: len(self._waiting))

    @property
    def tokens(self) -> float:
        """The tokens in the bucket now (refilled to this moment)."""
        self._refill()
        return self._tokens

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self._capacity, self._tokens + (now - self._refilled) * self._rate)
        self._refilled = now

    async def admit(self) -> Answer | None:
        """None once the request holds a token (call `release` when its answer is handed
        over); otherwise the refusal to answer, the request holding nothing."""
        self._refill()
        if not self._waiting and self._tokens >= 1:
            self._tokens -= 1
            return None
        config = self._config
        if len(self._waiting) >= config.queue_size:
            self.refused.labels("queue_full").inc()
            message = (
                f"too many requests: all {config.max_concurrent_requests} admission tokens "
                f"are taken and the queue of {config.queue_size} is full "
                "(--max-concurrent-requests, --queue-size)"
            )
            retry = str(max(1, math.ceil(1 / self._rate)))
            body = error_body(message, "rate_limit_exceeded")
            return Answer(429, body, headers=(("retry-after", retry),))
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        self._schedule()
        try:
            async with asyncio.timeout(config.queue_timeout_secs):
                await asyncio.shield(waiter)
        except TimeoutError:
            if not self._leave(waiter):
                return None  # granted as the timeout fired: served after all
            self.refused.labels("queue_timeout").inc()
            message = (
                f"request timed out after {config.queue_timeout_secs:g} s in the admission "
                "queue (--queue-timeout-secs)"
            )
            return Answer(408, error_body(message, "request_timeout"))
        except asyncio.CancelledError:
            if not self._leave(waiter):
                self.release()  # granted, but the client left: the token goes on
            raise
        return None

    def _leave(self, waiter: asyncio.Future[None]) -> bool:
        """Take `waiter` out of the queue; False when it had already been granted a token."""
        if waiter.done():
            return False
        self._waiting.remove(waiter)
        waiter.cancel()
        return True

    def release(self) -> None:
        """A served request's token back in the bucket, for the longest waiter first."""
        self._refill()
        self._tokens = min(self._capacity, self._tokens + 1)
        self._grant()

    def _grant(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._refill()
        while self._waiting and self._tokens >= 1:
            self._tokens -= 1
            self._waiting.popleft().set_result(None)
        self._schedule()

    def _schedule(self) -> None:
        """Wake when the refill will have made the next token, while anyone waits."""
        if self._waiting and self._timer is None:
            delay = max(0.0, (1 - self._tokens) / self._rate)
            self._timer = asyncio.get_running_loop().call_later(delay, self._grant)
