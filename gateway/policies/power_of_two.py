"""Two random candidates, the less loaded wins (sglang-router's decode default).

Load is requests in flight, then prefill tokens queued; on a tie the first drawn wins.
Sampling two keeps herds from piling onto one momentarily idle worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from random import Random

from gateway.load.tracker import Candidate
from gateway.policies.base import Choice
from gateway.requests.query import RouteQuery


class PowerOfTwoPolicy:
    name = "power_of_two"
    uses_index = False
    reads_load = True

    def __init__(self, rng: Random) -> None:
        self._rng = rng

    def choose(self, request: RouteQuery, candidates: Sequence[Candidate]) -> Choice:
        if len(candidates) == 1:
            chosen = candidates[0]
        else:
            first, second = self._rng.sample(range(len(candidates)), 2)
            a, b = candidates[first], candidates[second]
            chosen = (
                b
                if (b.in_flight, b.queued_prefill_tokens)
                < (
                    a.in_flight,
                    a.queued_prefill_tokens,
                )
                else a
            )
        return Choice(chosen.worker, uncached_tokens=request.prompt_tokens)

    def forget(self, worker: str) -> None:
        """Nothing is kept per worker."""
