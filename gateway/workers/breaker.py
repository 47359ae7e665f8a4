"""A circuit breaker per worker, as sglang-router's: pure state, time read from a clock.

Closed: counts consecutive failures; `failure_threshold` of them open it (never when it is
disabled). Open: every request is refused until `timeout_duration_secs` have passed, then
it is half-open.
Half-open: requests flow; `success_threshold` consecutive successes close it, any failure
opens it again. Which outcomes are failures is the caller's decision
(`is_failure_status`): 5xx, 408, 429 and transport errors, never other 4xx, which are the
client's fault.

Every change of state is told to `on_change` with why (the pool logs it): an operator must
see a worker taken out of traffic, and when it is let back, without reading metrics.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from gateway.settings.workers import BreakerConfig
from kvplumbing.clock import Clock

FAILURE_STATUSES = frozenset({408, 429})


def is_failure_status(status: int) -> bool:
    return status >= 500 or status in FAILURE_STATUSES


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"

    @property
    def gauge(self) -> int:
        """The value exported as a metric: 0 closed, 1 open, 2 half-open."""
        return {"closed": 0, "open": 1, "half_open": 2}[self.value]


@dataclass(frozen=True, slots=True)
class BreakerStats:
    state: BreakerState
    consecutive_failures: int
    consecutive_successes: int
    total_failures: int
    total_successes: int
    opened_at: float | None


Transition = Callable[["BreakerState", "BreakerState", str], None]
"""Told each change of state: from, to, and why."""


def _ignore(before: BreakerState, after: BreakerState, why: str) -> None:
    return None


class CircuitBreaker:
    def __init__(
        self, config: BreakerConfig, clock: Clock, on_change: Transition = _ignore
    ) -> None:
        self._config = config
        self._clock = clock
        self._on_change = on_change
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._successes = 0
        self._total_failures = 0
        self._total_successes = 0
        self._opened_at: float | None = None

    @property
    def state(self) -> BreakerState:
        if (
            self._state is BreakerState.OPEN
            and self._opened_at is not None
            and self._clock() - self._opened_at >= self._config.timeout_duration_secs
        ):
            self._state = BreakerState.HALF_OPEN
            self._successes = 0
            waited = self._config.timeout_duration_secs
            self._on_change(BreakerState.OPEN, BreakerState.HALF_OPEN, f"open for {waited:g} s")
        return self._state

    def retry_in(self) -> float | None:
        """Seconds until an open circuit lets a request through again; None unless open."""
        if self.state is not BreakerState.OPEN or self._opened_at is None:
            return None
        return max(0.0, self._opened_at + self._config.timeout_duration_secs - self._clock())

    @property
    def failures(self) -> int:
        """Consecutive failed calls now."""
        return self._failures

    @property
    def opened(self) -> bool:
        """Open as last left: an open circuit turns half-open by the clock, when next read,
        so what it allows can change without an event."""
        return self._state is BreakerState.OPEN

    def allows(self) -> bool:
        # Read per worker per request: a closed circuit answers without the state's
        # property (which only changes an open one) or the configuration.
        if self._state is not BreakerState.OPEN:
            return True
        return self._config.disabled or self.state is not BreakerState.OPEN

    def record(self, success: bool, error: str | None = None) -> None:
        """One call's outcome; `error`, a failure's, is given as why the circuit opened."""
        state = self.state
        if success:
            self._total_successes += 1
            self._failures = 0
            self._successes += 1
            if (
                state is BreakerState.HALF_OPEN
                and self._successes >= self._config.success_threshold
            ):
                self._state = BreakerState.CLOSED
                self._opened_at = None
                why = f"{self._successes} calls in a row succeeded"
                self._on_change(BreakerState.HALF_OPEN, BreakerState.CLOSED, why)
            return
        self._total_failures += 1
        self._successes = 0
        self._failures += 1
        if self._config.disabled:
            return
        if state is BreakerState.HALF_OPEN or (
            state is BreakerState.CLOSED and self._failures >= self._config.failure_threshold
        ):
            self._state = BreakerState.OPEN
            self._opened_at = self._clock()
            if state is BreakerState.HALF_OPEN:
                why = "a call failed while half-open"
            else:
                why = f"{self._failures} calls in a row failed"
            last = f", the last: {error}" if error else ""
            self._on_change(state, BreakerState.OPEN, f"{why}{last}")

    def stats(self) -> BreakerStats:
        return BreakerStats(
            state=self.state,
            consecutive_failures=self._failures,
            consecutive_successes=self._successes,
            total_failures=self._total_failures,
            total_successes=self._total_successes,
            opened_at=self._opened_at,
        )
