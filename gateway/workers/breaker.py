"""A circuit breaker per worker, as sglang-router's: pure state, time read from a clock.

Closed: counts consecutive failures; `failure_threshold` of them open it. Open: every
request is refused until `timeout_duration_secs` have passed, then it is half-open.
Half-open: requests flow; `success_threshold` consecutive successes close it, any failure
opens it again. Which outcomes are failures is the caller's decision
(`is_failure_status`): 5xx, 408, 429 and transport errors, never other 4xx, which are the
client's fault.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from gateway.config import BreakerConfig
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


class CircuitBreaker:
    def __init__(self, config: BreakerConfig, clock: Clock) -> None:
        self._config = config
        self._clock = clock
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
        return self._state

    def allows(self) -> bool:
        return self._config.disabled or self.state is not BreakerState.OPEN

    def record(self, success: bool) -> None:
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
            return
        self._total_failures += 1
        self._successes = 0
        self._failures += 1
        if state is BreakerState.HALF_OPEN or (
            state is BreakerState.CLOSED and self._failures >= self._config.failure_threshold
        ):
            self._state = BreakerState.OPEN
            self._opened_at = self._clock()

    def stats(self) -> BreakerStats:
        return BreakerStats(
            state=self.state,
            consecutive_failures=self._failures,
            consecutive_successes=self._successes,
            total_failures=self._total_failures,
            total_successes=self._total_successes,
            opened_at=self._opened_at,
        )
