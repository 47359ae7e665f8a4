"""What an incoming seq means for a source, and what a replay can repair. Pure functions.

A publisher numbers its batches 0, 1, 2, … from its own start, so a source's seq must be
exactly the last applied + 1. Anything else is one of three situations, each recovered
differently by the worker:

- GAP: batches [expected, seq) were lost on the way (PUB drops at its high-water mark, a
  slow subscriber, a reconnect). Replay them; if the replay cannot give all of them, the
  index may hold blocks the engine has since removed, so the source is reset.
- JOIN: the first batch we ever see for a source that has no state in the index, seq > 0
  (the indexer started after the engine). Replay what the engine still buffers; nothing
  to reset, the index holds nothing stale for it.
- RESTART: seq went backwards: the engine restarted and lost its cache. Reset the source,
  then replay the new incarnation's first batches if we missed them.

A source reset and then fed a *contiguous* run of batches up to the live one holds a
subset of what the engine holds (blocks stored before the run are missing, never extra),
which is why a short replay's tail is still applied after the reset.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from globalkv.ingest.border import Received


class Step(enum.Enum):
    APPLY = "apply"
    GAP = "gap"
    JOIN = "join"
    RESTART = "restart"


def classify(expected: int | None, seq: int) -> Step:
    """`expected` is the next seq to apply, None when the source has no state yet."""
    if expected is None:
        return Step.APPLY if seq == 0 else Step.JOIN
    if seq == expected:
        return Step.APPLY
    return Step.GAP if seq > expected else Step.RESTART


def contiguous_tail(
    batches: Sequence[Received], start: int, stop: int
) -> tuple[list[Received], bool]:
    """The replayed batches to apply for the missing range [start, stop), and whether the
    range is complete.

    Replies outside the range are ignored (a replay returns everything buffered from
    `start`, including batches we already have live). When the range is not complete,
    the longest run ending at `stop - 1` is returned: those can be applied after a reset.
    """
    by_seq = {b.seq: b for b in batches if start <= b.seq < stop}
    if len(by_seq) == stop - start:
        return [by_seq[s] for s in range(start, stop)], True
    tail: list[Received] = []
    seq = stop - 1
    while seq >= start and seq in by_seq:
        tail.append(by_seq[seq])
        seq -= 1
    tail.reverse()
    return tail, False
