"""When to try again and how long to wait: sglang-router's retry rules as pure parts.

The executor that loops lives in `gateway.dispatch`; it asks `Backoff.delay(n)` for the
pause before attempt n+1 and `is_retryable_status` whether an answer deserves one.
"""

from __future__ import annotations

from random import Random

from gateway.config import RetryConfig

RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


def is_retryable_status(status: int) -> bool:
    return status in RETRYABLE_STATUSES


class Backoff:
    """initial × multiplier^n, capped, then ± jitter: 50 ms × 1.5^n ≤ 30 s, ±20 % by default."""

    def __init__(self, config: RetryConfig, rng: Random) -> None:
        self._config = config
        self._rng = rng

    @property
    def max_attempts(self) -> int:
        return 1 if self._config.disabled else self._config.max_retries

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number `retry` (0 = the first retry)."""
        cfg = self._config
        base = min(cfg.initial_backoff_ms * cfg.backoff_multiplier**retry, cfg.max_backoff_ms)
        jitter = 1.0 + self._rng.uniform(-cfg.jitter_factor, cfg.jitter_factor)
        return max(0.0, base * jitter) / 1000.0
