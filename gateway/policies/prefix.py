"""Global-prefix routing: the prefill expected to give the first token soonest.

Score of a candidate prefill worker `w` (lower is better), in token units:

    hit(w)      = the longest prefix of the prompt w holds, in tokens: the longer of what
                  the index shows on w's pod (the best of its DP ranks) and what this
                  gateway sent w that the index may not show yet (`RouteQuery.pending`,
                  see `gateway.load.pending`); 0 without either
    uncached(w) = max(prompt_tokens - hit(w), 0)
    cost(w)     = uncached_weight * uncached(w)                 (--prefix-uncached-weight, 1.0)
                + queued_weight   * remaining_prefill_tokens(w) (--prefix-queued-weight, 0.5)
                + request_cost    * in_flight(w)                (--prefix-request-cost, 0.0)
                + pressure_weight * evicted(w)                  (--prefix-pressure-weight, 2.0)

`remaining_prefill_tokens(w)` is the work w must do before it reaches this prompt: of the
uncached tokens of the prompts this gateway sent w whose prefill has not answered, the part
not yet computed by w's measured prefill rate (`gateway.load.progress`; all of them
until w has answered once). A pod holding 6,000 cached tokens of an 8,000-token prompt
(uncached 2,000) but with 14,000 tokens left to compute costs 2,000 + 7,000 = 9,000 and
loses to an idle pod holding 1,000 (cost 7,000). The lowest cost wins; equal costs go to
the candidate with the fewest requests in flight, then to the seeded RNG (prompts nobody
holds cost alike everywhere once their prefills answered: what still differs is the
requests in flight). The choice carries the DP rank of the counted hit, so the room can
select it.

The queue weighs half a token: at 1.0 the cost is the greedy estimate of this request's
time to first token, which leaves a prefix's holder as soon as its queue is longer than
the prefix, and the copies it then makes evict other prefixes.

Cache pressure. `evicted(w)` is what computing this prompt's uncached blocks on w is
expected to cost other prompts, in tokens: the blocks it will evict there that are wanted
again (`gateway.policies.placement`). The blocks w would compute split in two: those
beyond the longest prefix any candidate holds (`top`), which every candidate but a holder
computes alike, and those between w's hit and `top`, a copy of what another pod holds,
which weigh twice (a copy evicts as a new block does and duplicates what the cluster
has). Without the cost a prompt nobody holds goes wherever the queue is shortest, and on
a full cluster one pod ends with more groups than its cache holds.

A copy is not charged when the prefix (its key at `top`) is in a larger share of the last
prompts placed than its holders are of the candidates: a copy then serves the prompts its
holders cannot keep up with; below that share it only takes room. The pressure weighs 2,
the weight that kept up with `cache_aware`'s hit rate at every capacity replayed without
giving up TTFT elsewhere; a worker whose capacity is not reported costs nothing here.
Every weight's measurements and the commands: `docs/gateway-design.md`.

Without a lookup (no tokens, no index configured, index unreachable) the policy hands the
choice to its load fallback (least_load) and marks it `fallback="no_lookup"`.

Sessions. A request naming a session (`RouteQuery.session`) knows where its last turn
went (`gateway.policies.sessions`). When this prompt extends that turn's (its key at the
last turn's last block is the same), the last turn's pod counts as holding that prefix
even where the index does not show it (not yet indexed, or the index blind): its cost
is computed with that hit, and a tie goes to it. So the conversation stays on its pod
while the pod is a candidate (healthy, circuit closed, ready) and not overloaded, and
overloaded means what the policy means everywhere: another pod is expected to give the
first token sooner. Without a lookup the last turn's prompt is counted as held there and
the other costs are the queued terms. The session follows the choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from random import Random

from gateway.load.held import held_prefixes
from gateway.load.tracker import Candidate
from gateway.policies.base import Choice, Policy
from gateway.policies.placement import PlacementLedger
from gateway.policies.sessions import SessionTable, Turn
from gateway.requests.query import RouteQuery
from gateway.settings.routing import PrefixWeights


class PrefixPolicy:
    name = "prefix"
    uses_index = True
    reads_load = True

    def __init__(self, weights: PrefixWeights, rng: Random, fallback: Policy) -> None:
        self._weights = weights
        self._rng = rng
        self._fallback = fallback
        self.ledger = PlacementLedger()
        ttl = weights.session_ttl_secs
        self.sessions = None if ttl is None else SessionTable(ttl, weights.sessions_max)

    def choose(self, request: RouteQuery, candidates: Sequence[Candidate]) -> Choice:
        sessions, session = self.sessions, request.session
        if sessions is None or session is None:
            return self._choose(request, candidates, None)
        choice = self._choose(request, candidates, sessions.get(session, request.now))
        lookup = request.lookup
        blocks = 0 if lookup is None else min(lookup.blocks, len(lookup.keys))
        last_key = lookup.keys[blocks - 1] if lookup is not None and blocks else None
        turn = Turn(choice.worker, request.prompt_tokens, blocks, last_key)
        sessions.bind(session, turn, request.now)
        return choice

    def _choose(
        self, request: RouteQuery, candidates: Sequence[Candidate], last: Turn | None
    ) -> Choice:
        if request.lookup is None or request.tokens is None:
            kept = self._kept_without_lookup(request, candidates, last)
            if kept is not None:
                return kept
            return replace(self._fallback.choose(request, candidates), fallback="no_lookup")
        prompt = request.prompt_tokens
        block_size = request.lookup.block_size
        w = self._weights
        blocks = request.lookup.blocks
        hits = held_prefixes(request.lookup, candidates, request.pending)
        if last is not None:
            extended = _extended(last, request.lookup.keys) * block_size
            hits = [
                (c, max(held, extended), rank) if c.worker == last.worker else (c, held, rank)
                for c, held, rank in hits
            ]
        top = min(max(h[1] for h in hits) // block_size, blocks)
        keys = request.lookup.keys
        copies_charged = (
            bool(w.pressure_weight)
            and 0 < top <= len(keys)
            and not self._hotter_than_holders(
                keys[top - 1], sum(h[1] // block_size >= top for h in hits), len(hits)
            )
        )
        scored: list[tuple[float, Candidate, int | None, int]] = []
        for candidate, hit_tokens, dp_rank in hits:
            uncached = max(prompt - hit_tokens, 0)
            cost = (
                w.uncached_weight * uncached
                + w.queued_weight * candidate.remaining_prefill_tokens
                + w.request_cost * candidate.in_flight
            )
            capacity = candidate.cache_capacity_tokens
            if w.pressure_weight and capacity is not None:
                copied = max(top - hit_tokens // block_size, 0) if copies_charged else 0
                evicted = self.ledger.eviction(
                    candidate.worker, capacity // block_size, blocks - top, copied
                )
                cost += w.pressure_weight * evicted * block_size
            scored.append((cost, candidate, dp_rank, uncached))
        lowest = min(s[0] for s in scored)
        tied = [s for s in scored if s[0] == lowest]
        if last is not None:
            tied = [s for s in tied if s[1].worker == last.worker] or tied
        if len(tied) > 1:
            fewest = min(s[1].in_flight for s in tied)
            tied = [s for s in tied if s[1].in_flight == fewest]
        _, chosen, dp_rank, uncached = (
            tied[self._rng.randrange(len(tied))] if len(tied) > 1 else tied[0]
        )
        if chosen.cache_capacity_tokens is not None:
            self.ledger.record(
                chosen.worker,
                chosen.cache_capacity_tokens // block_size,
                keys,
                (prompt - uncached) // block_size,
            )
        return Choice(
            chosen.worker,
            dp_rank=dp_rank,
            hit_tokens=prompt - uncached,
            uncached_tokens=uncached,
        )

    def _kept_without_lookup(
        self, request: RouteQuery, candidates: Sequence[Candidate], last: Turn | None
    ) -> Choice | None:
        """The session's prefill when, its last turn's prompt counted as held there and
        the queued terms as they are, no other candidate costs less."""
        if last is None:
            return None
        w = self._weights

        def queued(c: Candidate) -> float:
            return w.queued_weight * c.remaining_prefill_tokens + w.request_cost * c.in_flight

        held = next((c for c in candidates if c.worker == last.worker), None)
        prompt = request.prompt_tokens
        credit = min(last.tokens, prompt)
        if held is None or queued(held) - w.uncached_weight * credit > min(map(queued, candidates)):
            return None
        return Choice(
            held.worker, hit_tokens=credit, uncached_tokens=prompt - credit, fallback="no_lookup"
        )

    def _hotter_than_holders(self, key: int, holders: int, candidates: int) -> bool:
        """Whether the prefix ending at `key` is wanted by more of the recent prompts than
        its `holders` can serve as their share of the `candidates`."""
        return self.ledger.demand(key) * candidates > holders

    def forget(self, worker: str) -> None:
        self.ledger.forget(worker)


def _extended(last: Turn, keys: Sequence[int]) -> int:
    """The last turn's whole blocks when this prompt extends its prompt, else 0."""
    blocks = last.blocks
    if not blocks or last.last_key is None or len(keys) < blocks:
        return 0
    return blocks if keys[blocks - 1] == last.last_key else 0
