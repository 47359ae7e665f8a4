"""Breaker, backoff and health tracking as pure parts with a fake clock."""

from __future__ import annotations

from random import Random

import pytest

from gateway.legs.retry import RetrySchedule, is_retryable_status
from gateway.settings.workers import BreakerConfig, HealthConfig, RetryConfig
from gateway.workers.breaker import BreakerState, CircuitBreaker, is_failure_status
from gateway.workers.health import Health, HealthTracker
from tests.support.clock import FakeClock


def test_breaker_opens_after_ten_failures_and_recovers_after_three_successes() -> None:
    clock = FakeClock(0.0)
    breaker = CircuitBreaker(BreakerConfig(), clock)
    for _ in range(9):
        breaker.record(False)
    breaker.record(True)
    for _ in range(9):
        breaker.record(False)
    assert breaker.state is BreakerState.CLOSED, "a success resets the consecutive count"
    breaker.record(False)
    assert breaker.state is BreakerState.OPEN
    assert not breaker.allows()
    clock.now = 59.9
    assert not breaker.allows()
    clock.now = 60.0
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.allows()
    breaker.record(True)
    breaker.record(True)
    assert breaker.state is BreakerState.HALF_OPEN
    breaker.record(True)
    assert breaker.state is BreakerState.CLOSED
    stats = breaker.stats()
    assert (stats.total_failures, stats.total_successes) == (19, 4)


def test_half_open_failure_reopens() -> None:
    clock = FakeClock(0.0)
    breaker = CircuitBreaker(BreakerConfig(failure_threshold=1, timeout_duration_secs=5), clock)
    breaker.record(False)
    clock.now = 5
    breaker.record(True)
    breaker.record(False)
    assert breaker.state is BreakerState.OPEN
    assert breaker.stats().opened_at == 5
    assert breaker.state.gauge == 1


def test_disabled_breaker_always_allows() -> None:
    breaker = CircuitBreaker(BreakerConfig(failure_threshold=1, disabled=True), FakeClock(0.0))
    breaker.record(False)
    assert breaker.allows()


@pytest.mark.parametrize(
    ("status", "failure", "retryable"),
    [
        (200, False, False),
        (400, False, False),
        (404, False, False),
        (408, True, True),
        (429, True, True),
        (500, True, True),
        (501, True, False),
        (503, True, True),
    ],
)
def test_status_classes(status: int, failure: bool, retryable: bool) -> None:
    assert is_failure_status(status) is failure
    assert is_retryable_status(status) is retryable


def test_backoff_grows_caps_and_jitters_within_twenty_percent() -> None:
    backoff = RetrySchedule(RetryConfig(), Random(1))
    assert backoff.max_attempts == 5
    for n, base in [(0, 0.05), (1, 0.075), (2, 0.1125), (30, 30.0)]:
        delays = [backoff.delay(n) for _ in range(200)]
        assert min(delays) >= base * 0.8 - 1e-9
        assert max(delays) <= base * 1.2 + 1e-9
        assert max(delays) - min(delays) > base * 0.2, "jitter is applied"
    assert RetrySchedule(RetryConfig(disabled=True), Random(0)).max_attempts == 1
    still = RetrySchedule(RetryConfig(jitter_factor=0), Random(0))
    assert still.delay(1) == pytest.approx(0.075)


def test_health_needs_thresholds_after_first_success() -> None:
    health = HealthTracker(HealthConfig())
    assert health.state is Health.UNKNOWN
    health.record(False, "refused")
    assert health.state is Health.UNKNOWN, "a worker still starting is not yet unhealthy"
    assert health.record(True) is Health.HEALTHY
    health.record(False, "500")
    health.record(False, "500")
    assert health.healthy
    assert health.record(False, "500") is Health.UNHEALTHY
    assert health.last_error == "500"
    assert health.record(True) is Health.UNHEALTHY
    assert health.record(True) is Health.HEALTHY
    never = HealthTracker(HealthConfig(failure_threshold=2))
    never.record(False)
    assert never.record(False) is Health.UNHEALTHY
    assert HealthTracker(HealthConfig(disabled=True)).record(False) is Health.HEALTHY
