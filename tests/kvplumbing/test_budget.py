"""The body budget: what one process holds of every request's body, in total."""

from __future__ import annotations

import pytest

from kvplumbing.budget import FLOOR, BodyBudget, default_total

MiB = 1024 * 1024


def test_bodies_take_what_arrives_until_the_total_and_give_it_back() -> None:
    budget = BodyBudget(64 * MiB)
    assert budget.reserve == 8 * MiB
    assert budget.small == 64 * 1024
    assert budget.take(0, 30 * MiB)
    assert budget.take(30 * MiB, 26 * MiB)  # 56 MiB: the total less the reserve
    assert not budget.take(56 * MiB, 1)  # a large body may not take the reserve
    assert budget.used == 56 * MiB
    budget.give(56 * MiB)
    assert budget.used == 0
    assert budget.peak == 56 * MiB


def test_the_reserve_is_for_small_bodies_only() -> None:
    budget = BodyBudget(64 * MiB)
    assert budget.take(0, 56 * MiB)
    assert not budget.fits(budget.small + 1)
    assert budget.fits(budget.small)
    assert budget.take(0, budget.small)  # a small body still gets in
    held = budget.small
    assert not budget.take(held, 1)  # ...until it grows past small
    assert budget.used == 56 * MiB + budget.small
    while budget.take(0, budget.small):  # small bodies fill the reserve, no further
        pass
    assert budget.used <= budget.total
    assert not budget.fits(1)


def test_an_announced_length_that_cannot_fit_is_told_before_anything_is_taken() -> None:
    budget = BodyBudget(64 * MiB)
    assert budget.fits(budget.largest)
    assert not budget.fits(budget.largest + 1)
    assert budget.used == 0


def test_default_total_is_twice_the_per_request_cap_and_at_least_the_floor() -> None:
    assert default_total(512 * MiB) == 1024 * MiB
    assert default_total(1 * MiB) == FLOOR


def test_a_budget_holds_something() -> None:
    with pytest.raises(ValueError, match="positive"):
        BodyBudget(0)
