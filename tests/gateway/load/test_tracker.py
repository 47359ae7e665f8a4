from __future__ import annotations

import pytest

from gateway.load.tracker import LoadTracker
from gateway.workers.pool import Directory


def test_each_verb_changes_only_its_part_of_the_load() -> None:
    loads = LoadTracker(clock=lambda: 0.0)
    prefill = loads.start_prefill("p", 300, cached_tokens=100, keys=[1, 2], dp_rank=1)
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
