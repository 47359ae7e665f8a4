"""Each candidate in turn: even spread, no knowledge of load or cache."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.load.tracker import Candidate
from gateway.policies.base import Choice
from gateway.requests.query import RouteQuery


class RoundRobinPolicy:
    name = "round_robin"
    uses_index = False
    reads_load = False

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: RouteQuery, candidates: Sequence[Candidate]) -> Choice:
        chosen = candidates[self._next % len(candidates)]
        self._next += 1
        return Choice(chosen.worker, uncached_tokens=request.prompt_tokens)

    def forget(self, worker: str) -> None:
        """Nothing is kept per worker."""
