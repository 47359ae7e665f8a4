"""Choosing per attempt between a PD pair and a decode that prefills locally.

Wraps the `Router` as the dispatcher's `Chooser`: each attempt asks the decider
(`gateway.routing.decider`) with the eligible prefills and the eligible decodes that can
prefill; a local choice becomes a plan whose legs are one call to that decode
(`gateway.legs.local`), any other goes to the router's pair as before. Every choice is
counted in `globalkv_gateway_pd_decisions_total{decision,reason}`, `always` included, so
an operator sees what the decider did and why. A decode that failed this request is not
chosen again to prefill it; the next attempt may still disaggregate.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace
from typing import get_args

from gateway.load.tracker import Candidate
from gateway.policies.base import NoCandidates
from gateway.requests.query import RouteQuery
from gateway.routing.decider import PdDecider, PdDecision, local_capable
from gateway.routing.plan import RoutePlan
from gateway.routing.router import Router
from gateway.settings.base import Kind
from gateway.telemetry.loop_metrics import Counter

_LOCAL_KINDS: tuple[Kind, ...] = tuple(k for k in get_args(Kind) if local_capable(k))


class PdChooser:
    def __init__(self, router: Router, decider: PdDecider, decisions: Counter) -> None:
        self.router = router
        self.decider = decider
        self._decisions = decisions
        self._always = decisions.labels("disaggregate", "always")

    def plan(self, query: RouteQuery, avoid: Collection[str] = ()) -> RoutePlan:
        """Raises `NoCandidates` naming the empty role, as `Router.plan` does."""
        if not self.decider.enabled:
            self._always.inc()
            return self.router.plan(query, avoid)
        decision = self._decide(query, avoid)
        self._decisions.labels("local" if decision.local else "disaggregate", decision.reason).inc()
        if not decision.local:
            return self.router.plan(query, avoid)
        assert decision.decode is not None
        assert decision.choice is not None
        decode = self.router.pool.get(decision.decode.worker)
        if decode is None:
            raise NoCandidates("a chosen worker left the pool")
        return RoutePlan(decode, decode, decision.choice, [], query.keys, local=True)

    def _decide(self, query: RouteQuery, avoid: Collection[str]) -> PdDecision:
        if query.batch is not None:
            return PdDecision(False, "batch")
        router = self.router
        decodes: list[Candidate] = [
            c
            for local in _LOCAL_KINDS
            if query.kind in (None, local)
            for c in router.candidates("decode", query, kind=local)
            if c.worker not in avoid
        ]
        prefills = router.prefills(query, avoid)
        if query.lookup is not None:
            query = replace(query, pending=router.loads.pending_blocks(query.lookup.keys))
        loads = router.loads
        return self.decider.decide(
            query, prefills, decodes, lambda worker: loads.load(worker).progress.tokens_per_s
        )
