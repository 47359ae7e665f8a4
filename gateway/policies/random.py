"""A uniformly random candidate, from the policy's own seeded RNG."""

from __future__ import annotations

from collections.abc import Sequence
from random import Random

from gateway.load.tracker import Candidate
from gateway.policies.base import Choice
from gateway.requests.query import RouteQuery


class RandomPolicy:
    name = "random"
    uses_index = False
    reads_load = False

    def __init__(self, rng: Random) -> None:
        self._rng = rng

    def choose(self, request: RouteQuery, candidates: Sequence[Candidate]) -> Choice:
        chosen = candidates[self._rng.randrange(len(candidates))]
        return Choice(chosen.worker, uncached_tokens=request.prompt_tokens)

    def forget(self, worker: str) -> None:
        """Nothing is kept per worker."""
