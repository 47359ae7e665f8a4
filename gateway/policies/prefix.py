"""Global-prefix routing: the prefill expected to give the first token soonest.

Score of a candidate prefill worker `w` (lower is better), in token units:

    hit(w)      = the longest prefix of the prompt w holds, in tokens: the longer of what
                  the index shows on w's pod (the best of its DP ranks) and what this
                  gateway sent w that the index may not show yet (`RouteRequest.pending`,
                  see `gateway.policies.pending`); 0 without either
    uncached(w) = max(prompt_tokens - hit(w), 0)
    cost(w)     = uncached_weight * uncached(w)                 (--prefix-uncached-weight, 1.0)
                + queued_weight   * remaining_prefill_tokens(w) (--prefix-queued-weight, 0.5)
                + request_cost    * in_flight(w)                (--prefix-request-cost, 0.0)
                + pressure_weight * evicted(w)                  (--prefix-pressure-weight, 2.0)

`remaining_prefill_tokens(w)` is the work w must do before it reaches this prompt: of the
uncached tokens of the prompts this gateway sent w whose prefill has not answered, the part
not yet computed by w's measured prefill rate (`gateway.policies.progress`; all of them
until w has answered once). A pod holding 6,000 cached tokens of an 8,000-token prompt
(uncached 2,000) but with 14,000 tokens left to compute costs 2,000 + 7,000 = 9,000 and
loses to an idle pod holding 1,000 (cost 7,000). The lowest cost wins; equal costs are
broken by the seeded RNG. The choice carries the DP rank of the counted hit, so the room
can select it.

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

Sessions. A request naming a session (`RouteRequest.session`) goes to the prefill its
last turn went to (`gateway.policies.sessions`) while that prefill is a candidate and not
overloaded: overloaded is its cost above exceeding the lowest by more than the whole
prompt, that is, another pod would be expected to answer sooner even computing every
token of it. Without a lookup the costs are the queued terms alone. The session is then
bound to whatever was chosen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from random import Random

from gateway.config import PrefixWeights
from gateway.policies.base import Candidate, Choice, Policy, RouteRequest
from gateway.policies.placement import PlacementLedger
from gateway.policies.sessions import SessionTable
from globalkv.lookup import PodHit


class PrefixPolicy:
    name = "prefix"
    uses_index = True

    def __init__(self, weights: PrefixWeights, rng: Random, fallback: Policy) -> None:
        self._weights = weights
        self._rng = rng
        self._fallback = fallback
        self.ledger = PlacementLedger()
        ttl = weights.session_ttl_secs
        self.sessions = None if ttl is None else SessionTable(ttl, weights.sessions_max)

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Choice:
        sessions, session = self.sessions, request.session
        if sessions is None or session is None:
            return self._choose(request, candidates, None)
        choice = self._choose(request, candidates, sessions.get(session, request.now))
        sessions.bind(session, choice.worker, request.now)
        return choice

    def _choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], bound: str | None
    ) -> Choice:
        if request.lookup is None or request.tokens is None:
            kept = self._kept_without_lookup(request, candidates, bound)
            if kept is not None:
                return kept
            return replace(self._fallback.choose(request, candidates), fallback="no_lookup")
        best: dict[str, PodHit] = {}
        for pod_hit in request.lookup.pods:
            held = best.get(pod_hit.pod)
            if held is None or pod_hit.hit_tokens > held.hit_tokens:
                best[pod_hit.pod] = pod_hit
        prompt = request.prompt_tokens
        block_size = request.lookup.block_size
        pending = request.pending
        w = self._weights
        blocks = request.lookup.blocks
        hits: list[tuple[Candidate, int, int | None]] = []
        for candidate in candidates:
            hit = best.get(candidate.pod)
            hit_tokens, dp_rank = (hit.hit_tokens, hit.dp_rank) if hit else (0, None)
            sent = pending.get(candidate.worker)
            if sent is not None and sent.blocks * block_size > hit_tokens:
                hit_tokens, dp_rank = sent.blocks * block_size, sent.dp_rank
            hits.append((candidate, hit_tokens, dp_rank))
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
        slack = w.session_slack * prompt
        staying = [s for s in scored if s[1].worker == bound and s[0] - lowest <= slack]
        tied = staying or [s for s in scored if s[0] == lowest]
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
        self, request: RouteRequest, candidates: Sequence[Candidate], bound: str | None
    ) -> Choice | None:
        """The session's prefill when, by the queued terms alone, it is not overloaded."""
        if bound is None:
            return None
        w = self._weights

        def queued(c: Candidate) -> float:
            return w.queued_weight * c.remaining_prefill_tokens + w.request_cost * c.in_flight

        held = next((c for c in candidates if c.worker == bound), None)
        slack = w.session_slack * request.prompt_tokens
        if held is None or queued(held) - min(map(queued, candidates)) > slack:
            return None
        return Choice(held.worker, uncached_tokens=request.prompt_tokens, fallback="no_lookup")

    def _hotter_than_holders(self, key: int, holders: int, candidates: int) -> bool:
        """Whether the prefix ending at `key` is wanted by more of the recent prompts than
        its `holders` can serve as their share of the `candidates`."""
        return self.ledger.demand(key) * candidates > holders

    def forget(self, worker: str) -> None:
        self.ledger.forget(worker)
