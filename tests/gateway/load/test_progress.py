"""The estimate of a prefill's remaining work: fluid backlog, fitted cost, bounds."""

from __future__ import annotations

import pytest

from gateway.load.progress import CostFit, PrefillProgress
from gateway.load.tracker import LoadTracker
from gateway.policies.base import Choice


def _measured(tokens_per_s: float) -> PrefillProgress:
    """A worker that computed one 1,000-token prompt from 0 s at this rate, idle since."""
    progress = PrefillProgress()
    progress.sent(0, 1000, now=0.0)
    progress.answered(0, now=1000 / tokens_per_s, computed=True)
    return progress


def test_without_a_measured_rate_everything_sent_is_still_ahead() -> None:
    progress = PrefillProgress()
    progress.sent(1, 1000, now=0.0)
    progress.sent(2, 500, now=1.0)
    assert progress.tokens_per_s is None
    assert progress.remaining(now=100.0) == 1500


def test_the_rate_is_tokens_answered_over_time_busy() -> None:
    """Idle time between prefills does not count: 1,000 tokens in 2 s busy, then an hour idle."""
    progress = PrefillProgress()
    progress.sent(1, 1000, now=10.0)
    progress.answered(1, now=12.0, computed=True)
    assert progress.tokens_per_s == pytest.approx(500.0)
    progress.sent(2, 2000, now=3600.0)
    assert progress.remaining(now=3601.0) == 1500
    assert progress.remaining(now=3603.0) == 500
    assert progress.tokens_per_s == pytest.approx(500.0), "reading does not change the rate"


def test_after_an_answer_the_backlog_drains_on_from_where_it_was() -> None:
    """Rate 1,000/s; prompts of 1,000 and 2,000 sent together; the first answers on time."""
    progress = _measured(tokens_per_s=1000)
    progress.sent(1, 1000, now=10.0)
    progress.sent(2, 2000, now=10.0)
    assert progress.remaining(now=10.5) == 2500
    progress.answered(1, now=11.0, computed=True)
    assert progress.tokens_per_s == pytest.approx(1000.0)
    assert progress.remaining(now=11.0) == 2000
    assert progress.remaining(now=11.5) == 1500


def test_an_answer_caps_the_backlog_at_what_is_still_open() -> None:
    """Measured slow (100/s), the worker answers the first of two 1,000-token prompts
    after 1 s: whatever the slow fit predicted, no more than the other's 1,000 is left."""
    progress = _measured(tokens_per_s=100)
    progress.sent(1, 1000, now=20.0)
    progress.sent(2, 1000, now=20.0)
    assert progress.remaining(now=20.0) == 2000
    progress.answered(1, now=21.0, computed=True)
    assert progress.remaining(now=21.0) == 1000


def test_a_rate_too_high_still_counts_everything_behind_the_oldest_prompt() -> None:
    """First come first served: only the oldest open prompt can be partly done, so an
    over-estimated rate cannot make a worker with prompts waiting look idle."""
    progress = _measured(tokens_per_s=10_000)
    progress.sent(1, 4000, now=5.0)
    progress.sent(2, 3000, now=5.0)
    assert progress.remaining(now=60.0) == 3000
    progress.answered(2, now=61.0, computed=True)
    assert progress.remaining(now=61.0) == 0, "only the oldest is left; the rate says it is done"


def test_a_failed_prefill_does_not_measure_the_rate() -> None:
    progress = PrefillProgress()
    progress.sent(1, 1000, now=0.0)
    progress.answered(1, now=0.01, computed=False)
    assert progress.tokens_per_s is None
    assert progress.remaining(now=0.01) == 0
    progress.answered(1, now=0.02, computed=True)
    assert progress.tokens_per_s is None, "an answer for a prompt not open is ignored"


def test_the_rate_follows_a_worker_that_slows_down() -> None:
    progress = PrefillProgress()
    now = 0.0
    for serial in range(200):
        progress.sent(serial, 1000, now)
        now += 1.0 if serial < 100 else 4.0
        progress.answered(serial, now, computed=True)
    rate = progress.tokens_per_s
    assert rate is not None
    assert 250 <= rate < 300


def _attention_seconds(tokens: int, context: int) -> float:
    """A worker at 4,000 tokens/s whose token at position p costs 1 + p / 50,000 tokens."""
    return tokens * (1 + (context + tokens / 2) / 50_000) / 4000


def test_a_cost_growing_with_context_is_fitted_and_long_contexts_count_for_more() -> None:
    progress = PrefillProgress()
    now = 0.0
    for serial, context in enumerate([0, 20_000, 60_000, 5000, 100_000] * 4):
        progress.sent(serial, 2000, now, context)
        now += _attention_seconds(2000, context)
        progress.answered(serial, now, computed=True)
    assert progress.fitted is not None
    a, b = progress.fitted
    assert a == pytest.approx(1 / 4000, rel=1e-6)
    assert b == pytest.approx(1 / 4000 / 50_000, rel=1e-6)
    rate = progress.tokens_per_s
    assert rate is not None
    seconds = _attention_seconds(2000, 100_000)
    progress.sent(100, 2000, now, context=100_000)
    assert progress.remaining(now) == pytest.approx(seconds * rate, abs=1)
    assert progress.remaining(now) > 2000 * 1.5, "tokens after a long context weigh more"
    assert progress.remaining(now + seconds / 2) == pytest.approx(seconds * rate / 2, abs=1)


def test_prompts_of_one_context_fit_the_linear_cost_alone() -> None:
    """The two terms cannot be told apart; the fit must not divide by next to nothing."""
    fit = CostFit()
    for _ in range(10):
        fit.add(1000, 1000 * 3000.0, 0.5)
    assert fit.coefficients() == pytest.approx((0.0005, 0.0))
    assert CostFit().coefficients() is None


def test_load_tracker_candidates_carry_the_estimate_on_its_clock() -> None:
    clock = [0.0]
    loads = LoadTracker(clock=lambda: clock[0])
    first = loads.start_prefill(Choice("p", uncached_tokens=1000))
    clock[0] = 2.0
    loads.prefill_done(first)
    second = loads.start_prefill(Choice("p", uncached_tokens=3000, hit_tokens=0))
    loads.start_decode("p")
    clock[0] = 4.0
    candidate = loads.candidate("p")
    assert (candidate.queued_prefill_tokens, candidate.remaining_prefill_tokens) == (3000, 2000)
    assert loads.candidates(["p", "idle"])[1].remaining_prefill_tokens == 0
    loads.finish(second, computed=False)
    assert loads.candidate("p").remaining_prefill_tokens == 0
    assert loads.load("p").progress.tokens_per_s == pytest.approx(500.0)
