from __future__ import annotations

import pytest

from globalkv.ingest.border import Received
from globalkv.ingest.sequencer import Step, classify, contiguous_tail
from globalkv.translate import Translated


@pytest.mark.parametrize(
    ("expected", "seq", "step"),
    [
        (None, 0, Step.APPLY),
        (None, 5, Step.JOIN),
        (3, 3, Step.APPLY),
        (3, 7, Step.GAP),
        (3, 2, Step.RESTART),
        (3, 0, Step.RESTART),
    ],
)
def test_classify(expected: int | None, seq: int, step: Step) -> None:
    assert classify(expected, seq) is step


def _batches(*seqs: int) -> list[Received]:
    return [Received(s, 0.0, Translated(ts=0.0, events=[])) for s in seqs]


def test_complete_range_ignores_batches_outside_it() -> None:
    tail, complete = contiguous_tail(_batches(1, 2, 3, 4, 5, 6), 2, 5)
    assert complete
    assert [f.seq for f in tail] == [2, 3, 4]


def test_short_range_keeps_the_run_that_reaches_the_live_seq() -> None:
    tail, complete = contiguous_tail(_batches(4, 6, 7, 8), 2, 9)
    assert not complete
    assert [f.seq for f in tail] == [6, 7, 8]


def test_a_run_not_reaching_the_live_seq_is_useless() -> None:
    tail, complete = contiguous_tail(_batches(2, 3, 4), 2, 9)
    assert not complete
    assert tail == []


def test_nothing_replayed() -> None:
    assert contiguous_tail([], 0, 3) == ([], False)
