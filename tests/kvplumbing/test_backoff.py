"""The one backoff formula: growth, cap, jitter bounds, and no overflow far out."""

from __future__ import annotations

import pytest

from kvplumbing.backoff import Backoff


def test_grows_by_the_multiplier_up_to_the_cap() -> None:
    backoff = Backoff(base=0.05, cap=2.0)
    assert [backoff.delay(n) for n in range(8)] == pytest.approx(
        [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    )


def test_jitter_spans_the_factor_range_by_the_draw() -> None:
    backoff = Backoff(base=1.0, cap=30.0, jitter=(0.75, 1.0))
    assert backoff.delay(2, 0.0) == 3.0
    assert backoff.delay(2, 0.5) == 3.5
    assert backoff.delay(2, 0.999999) == pytest.approx(4.0, rel=1e-5)


def test_spread_is_plus_or_minus_a_fraction() -> None:
    backoff = Backoff.spread(0.05, 30.0, 1.5, 0.2)
    assert backoff.jitter == (0.8, 1.2)
    assert backoff.delay(1, 0.0) == pytest.approx(0.075 * 0.8)
    assert backoff.delay(1, 1.0) == pytest.approx(0.075 * 1.2)
    assert Backoff.spread(1.0, 1.0, 1.0, 0.0).delay(5, 0.7) == 1.0


def test_a_try_far_out_is_capped_not_an_overflow() -> None:
    assert Backoff(base=0.05, cap=30.0, multiplier=1.5).delay(5000) == 30.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"base": -1.0, "cap": 1.0},
        {"base": 1.0, "cap": -1.0},
        {"base": 1.0, "cap": 1.0, "multiplier": 0.5},
        {"base": 1.0, "cap": 1.0, "jitter": (1.2, 0.8)},
        {"base": 1.0, "cap": 1.0, "jitter": (-0.1, 1.0)},
    ],
)
def test_a_schedule_that_cannot_be_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="backoff"):
        Backoff(**kwargs)  # type: ignore[arg-type]
