from __future__ import annotations

import pytest

from gateway.load.tracker import LoadTracker
from gateway.policies.base import Choice
from gateway.routing.plan import RoutePlan
from gateway.settings.workers import BreakerConfig, HealthConfig, WorkerSpec
from gateway.workers.directory import Directory
from gateway.workers.pool import WorkerPool


def test_each_verb_changes_only_its_part_of_the_load() -> None:
    loads = LoadTracker(clock=lambda: 0.0)
    prefill = loads.start_prefill(Choice("p", uncached_tokens=300, hit_tokens=100), [1, 2], 1)
    decode = loads.start_decode("p")
    load = loads.load("p")
    assert (load.in_flight, load.queued_prefill_tokens) == (2, 300)
    assert loads.pending_blocks([1, 2])["p"].dp_rank == 1
    assert decode.pending is None
    assert not decode.prefill_open
    loads.prefill_done(prefill)
    assert (load.in_flight, load.queued_prefill_tokens) == (2, 0)
    loads.finish(decode)
    loads.finish(prefill)
    assert load.in_flight == 0


@pytest.mark.parametrize(
    ("dp_size", "follows", "room", "pinned", "rank"),
    [
        (1, False, None, None, 0),
        (1, True, 7, None, 0),
        (4, True, 7, None, 3),
        (4, True, None, None, None),
        (4, False, 7, 2, 2),
        (4, False, 7, None, None),
    ],
)
def test_one_rule_names_the_dp_rank_that_computes_a_prompt(
    dp_size: int, follows: bool, room: int | None, pinned: int | None, rank: int | None
) -> None:
    directory = Directory(dp_size=dp_size, follow_bootstrap_room=follows)
    assert directory.computing_rank(room, pinned) == rank


def test_a_plan_keeps_its_prompt_pending_on_the_rank_its_first_room_selects() -> None:
    pool = WorkerPool(BreakerConfig(), HealthConfig(), lambda: 0.0)
    prefill = pool.add(WorkerSpec(url="http://p:1", role="prefill", bootstrap_port=8998))
    prefill.directory.dp_size, prefill.directory.follow_bootstrap_room = 4, True
    loads = LoadTracker(clock=lambda: 0.0)
    choice = Choice(prefill.id, uncached_tokens=10)
    drawn = RoutePlan(prefill, prefill, choice, [7, 8], [1, 2])
    undrawn = RoutePlan(prefill, prefill, choice, [], [3, 4])  # an endpoint picker's
    for plan in (drawn, undrawn):
        loads.start_prefill(plan.prefill_choice, plan.keys, plan.dp_rank)
    assert loads.pending_blocks([1, 2])[prefill.id].dp_rank == 3
    assert loads.pending_blocks([3, 4])[prefill.id].dp_rank is None


def test_a_request_moved_to_another_worker_is_in_flight_there_only() -> None:
    loads = LoadTracker(clock=lambda: 0.0)
    chosen = loads.start_prefill(Choice("p", uncached_tokens=300), [1, 2])
    moved = loads.move(chosen, "q")
    assert not chosen.open
    assert (loads.load("p").in_flight, loads.load("p").queued_prefill_tokens) == (0, 0)
    assert loads.pending_blocks([1, 2]) == {}, "not computed where it was sent"
    assert (loads.load("q").in_flight, loads.load("q").queued_prefill_tokens) == (1, 0)
    assert moved.pending is None
    loads.finish(moved)
    assert loads.load("q").in_flight == 0
