"""The candidate with the least prefill work queued, then the fewest requests in flight.

The load fallback of the cache-based policies: with no tokens or no index it is the best
guess of the shortest wait. Ties are broken by the seeded RNG so equal workers share load.
"""

from __future__ import annotations

from collections.abc import Sequence
from random import Random

from gateway.load.tracker import Candidate
from gateway.policies.base import Choice
from gateway.requests.query import RouteQuery


class LeastLoadPolicy:
    name = "least_load"
    uses_index = False
    reads_load = True

    def __init__(self, rng: Random) -> None:
        self._rng = rng

    def choose(self, request: RouteQuery, candidates: Sequence[Candidate]) -> Choice:
        best = min((c.queued_prefill_tokens, c.in_flight) for c in candidates)
        tied = [c for c in candidates if (c.queued_prefill_tokens, c.in_flight) == best]
        chosen = tied[self._rng.randrange(len(tied))] if len(tied) > 1 else tied[0]
        return Choice(chosen.worker, uncached_tokens=request.prompt_tokens)

    def forget(self, worker: str) -> None:
        """Nothing is kept per worker."""
