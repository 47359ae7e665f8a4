"""When to try again and how long to wait: sglang-router's retry rules as pure parts.

The executor that loops lives in `gateway.legs.dispatch`; it asks `RetrySchedule.delay(n)` for
the pause before attempt n+1 and `is_retryable_status` whether an answer deserves one.
"""

from __future__ import annotations

from random import Random

from gateway.settings.workers import RetryConfig
from kvplumbing.backoff import Backoff

RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


def is_retryable_status(status: int) -> bool:
    return status in RETRYABLE_STATUSES


class RetrySchedule:
    """How many attempts a request gets, and the pause before each retry: initial ×
    multiplier^n, capped, then ± jitter (50 ms × 1.5^n ≤ 30 s, ±20 % by default)."""

    def __init__(self, config: RetryConfig, rng: Random) -> None:
        self._config = config
        self._rng = rng
        self._backoff = Backoff.spread(
            config.initial_backoff_ms / 1000.0,
            config.max_backoff_ms / 1000.0,
            config.backoff_multiplier,
            config.jitter_factor,
        )

    @property
    def max_attempts(self) -> int:
        return 1 if self._config.disabled else self._config.max_retries

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number `retry` (0 = the first retry)."""
        return self._backoff.delay(retry, self._rng.random())
