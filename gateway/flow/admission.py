"""Admission control under sglang-router's flags (`--max-concurrent-requests`,
`--queue-size`, `--queue-timeout-secs`, `--rate-limit-tokens-per-second`).

Two limits, each exact on its own:

- **concurrency**: at most `max_concurrent_requests` requests are served at once. A
  request holds its place until its answer is over (a stream's: until its last byte or
  the client leaving), so the limit counts what the workers are really doing;
- **rate**, only when `rate_limit_tokens_per_second` is given: a token bucket of
  `max_concurrent_requests` tokens refilled at that rate, one spent per request started
  and never given back, so at most that many requests start per second after a burst of
  the bucket's size.

sglang-router (smg) has one token bucket for both: a request takes a token, gives it back
when its answer ends, and the bucket also refills at `--rate-limit-tokens-per-second`
(by default `--max-concurrent-requests` per second). Tokens returned and tokens refilled
add up, so it bounds neither: with 2 tokens, their default refill and requests of 5 s,
12 run at once after 5 s and 2 more every second after. Here the concurrency limit holds
whatever the refill, and the rate applies only when asked for (`docs/sglang-router-flags.md`
compares the two).

A request that cannot start waits in a FIFO queue of at most `queue_size` (sglang-router's
waiting requests race for each token; here none is overtaken); a full queue (or none,
`queue_size` 0) is answered 429 at once and a wait past `queue_timeout_secs` 408. Each
refusal carries an OpenAI-style error body saying which limit it met, and the 429 a
`Retry-After` header.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Awaitable, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.http.answer import Answer, error_body
from gateway.settings.edge import AdmissionConfig
from kvplumbing.clock import Clock


class RateBucket:
    """`capacity` tokens refilled at `rate` per second; a token spent is gone."""

    def __init__(self, capacity: float, rate: float, clock: Clock) -> None:
        self._capacity = capacity
        self.rate = rate
        self._clock = clock
        self._tokens = capacity
        self._refilled = clock()

    @property
    def tokens(self) -> float:
        """The tokens in the bucket now (refilled to this moment)."""
        now = self._clock()
        self._tokens = min(self._capacity, self._tokens + (now - self._refilled) * self.rate)
        self._refilled = now
        return self._tokens

    def take(self) -> bool:
        if self.tokens < 1:
            return False
        self._tokens -= 1
        return True

    def wait_s(self) -> float:
        """Seconds until the next token."""
        return max(0.0, (1 - self.tokens) / self.rate)


class Admission:
    """One gateway's limits and queue; `admit` before serving, `release` once the answer
    is over."""

    def __init__(self, config: AdmissionConfig, clock: Clock, registry: CollectorRegistry) -> None:
        assert config.max_concurrent_requests > 0, "build only with a limit"
        self._config = config
        self._limit = config.max_concurrent_requests
        self.running = 0
        """Requests admitted whose answer is not over."""
        rate = config.rate_limit_tokens_per_second
        self._bucket = None if rate is None else RateBucket(float(self._limit), rate, clock)
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
            "Requests waiting in the admission queue.",
            registry=registry,
        )
        self.queued.set_function(lambda: len(self._waiting))

    def _start(self) -> bool:
        """Take a place (and a token, with a rate) when both are free."""
        if self.running >= self._limit:
            return False
        if self._bucket is not None and not self._bucket.take():
            return False
        self.running += 1
        return True

    def admit_now(self) -> bool:
        """A place taken at once, where one is free and nobody waits for one (`release`
        it as `admit`'s); False: `admit` the request instead."""
        return not self._waiting and self._start()

    async def admit(self, waiting: Callable[[], Awaitable[None]] | None = None) -> Answer | None:
        """None once the request holds its place (call `release` when its answer is over);
        otherwise the refusal to answer, the request holding nothing. `waiting` is awaited
        once the request waits in the queue instead of starting at once (the picker tells
        its data plane to wait longer)."""
        if not self._waiting and self._start():
            return None
        config = self._config
        if len(self._waiting) >= config.queue_size:
            self.refused.labels("queue_full").inc()
            limits = f"all {self._limit} places are taken (--max-concurrent-requests)"
            if self._bucket is not None and self.running < self._limit:
                limits = (
                    f"requests start at most {self._bucket.rate:g} per second "
                    "(--rate-limit-tokens-per-second)"
                )
            message = (
                f"too many requests: {limits} and the queue of {config.queue_size} is full "
                "(--queue-size)"
            )
            rate = self._bucket.rate if self._bucket is not None else 1.0
            retry = str(max(1, math.ceil(1 / rate)))
            body = error_body(message, "rate_limit_exceeded")
            return Answer(429, body, headers=(("retry-after", retry),))
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        self._schedule()
        try:
            async with asyncio.timeout(config.queue_timeout_secs):
                if waiting is not None and not waiter.done():
                    await waiting()
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
        except BaseException:  # the client left, or telling it failed
            if not self._leave(waiter):
                self.release()  # granted: the place goes on
            raise
        return None

    def _leave(self, waiter: asyncio.Future[None]) -> bool:
        """Take `waiter` out of the queue; False when it had already been granted."""
        if waiter.done():
            return False
        self._waiting.remove(waiter)
        waiter.cancel()
        self._grant()  # it may have stood at the head, waiting for a token
        return True

    def release(self) -> None:
        """A request's answer is over: its place goes to the longest waiter."""
        self.running -= 1
        self._grant()

    def _grant(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._waiting and self._start():
            self._waiting.popleft().set_result(None)
        self._schedule()

    def _schedule(self) -> None:
        """With a rate, wake when the next token is made while someone waits with a place
        free (a place freed wakes them through `release`)."""
        bucket = self._bucket
        if bucket is None or not self._waiting or self._timer is not None:
            return
        if self.running < self._limit:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(bucket.wait_s(), self._grant)
