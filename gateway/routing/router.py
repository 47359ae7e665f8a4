"""Choosing a pair: the index lookup, the two policies, and the rooms. Nothing is sent here.

Per request, `namespace()` reads where the prompt's KV is cached (model, LoRA adapter,
cache salt: `gateway.requests.namespace.request_namespace`, over the adapters the workers list) and
`look_up()` asks the index once under it for the request's `RouteQuery` (only when the
prefill policy uses it and the prompt's tokens are known); per attempt, `plan()` picks a
prefill and a decode among the eligible workers — avoiding those that already failed this
request while others remain, serving the request's model when workers advertise it, and
every LoRA adapter it names, of the kind asked for when one is (SGLang's `/generate` goes
to SGLang pairs only: vLLM serves no such path), the decode of the prefill's kind — and
draws fresh rooms. When the index cannot be used the request is still routed, by load; the
reason is counted in `globalkv_gateway_routing_fallbacks` and logged once.

DP-aware rooms: when the chosen prefill's directory says `follow_bootstrap_room` and its
DP size is above 1, and the choice names the DP rank holding the hit, every room is drawn
so that `room % dp_size` is that rank: the decode then reads its KV from the rank that
has the prefix cached. Otherwise rooms are uniform in [1, 2^63-1] (`gateway.routing.rooms`);
with `--dp-aware` (sglang-router's flag) that rank is then named in the request instead
(`gateway.routing.plan.RoutePlan.pinned_dp_rank`, injected by the SGLang legs).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from random import Random
from typing import Any

from gateway.load.tracker import Candidate, LoadTracker
from gateway.policies.base import Choice, NoCandidates, Policy
from gateway.requests.namespace import RequestNamespace, request_namespace
from gateway.requests.query import RouteQuery
from gateway.routing.plan import RoutePlan
from gateway.routing.rooms import draw_room
from gateway.settings.base import Kind, Role
from gateway.telemetry.metrics import GatewayMetrics
from gateway.workers.pool import Worker, WorkerPool
from globalkv.index.base import IndexUnavailable
from globalkv.lookup import LookupResult, PrefixLookup
from kvplumbing.clock import Clock

log = logging.getLogger(__name__)


class Router:
    def __init__(
        self,
        pool: WorkerPool,
        loads: LoadTracker,
        prefill_policy: Policy,
        decode_policy: Policy,
        metrics: GatewayMetrics,
        clock: Clock,
        *,
        lookup: PrefixLookup | None,
        model: Callable[[str | None], str | None],
        lookup_timeout: float = 0.5,
        room_rng: Random | None = None,
        dp_aware: bool = False,
    ) -> None:
        self.pool = pool
        self._dp_aware = dp_aware
        self.loads = loads
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self._metrics = metrics
        self._clock = clock
        self._lookup = lookup
        self._model = model
        self._lookup_timeout = lookup_timeout
        self._rooms = room_rng or Random()
        self._logged: set[str] = set()
        decisions = metrics.decisions
        self._decode_decision = decisions.labels("decode", decode_policy.name, "load")
        self._prefill_decisions = {
            outcome: decisions.labels("prefill", prefill_policy.name, outcome)
            for outcome in ("hit", "miss", "fallback")
        }

    @property
    def uses_index(self) -> bool:
        return self.prefill_policy.uses_index

    def fallback(self, reason: str, detail: str = "") -> None:
        self._metrics.fallbacks.labels(reason).inc()
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning(
                "routing prefill by load instead of the KV index: %s%s (logged once)",
                reason,
                f" ({detail})" if detail else "",
            )

    def namespace(self, body: Mapping[str, Any]) -> RequestNamespace:
        """The request's namespace over what the workers serve now; raises
        `UnknownAdapter` and `BadRequest` (`gateway.requests.namespace.request_namespace`)."""
        served = self.pool.served()
        models = served.models
        configured = self._model(None)
        if configured is not None and configured not in models:
            models = models | {configured}
        return request_namespace(body, served.adapters, models)

    async def look_up(self, query: RouteQuery) -> None:
        """The index's answer for the query's prompt in its namespace into `query.lookup`
        (None, the reason counted, where there is none), and the time choosing reads into
        `query.now`. Again after the request waited (flow control): it is then placed on
        what the index shows by then."""
        model = self._indexed_model(query) if self.prefill_policy.uses_index else None
        if model is None:
            self.unindexed(query)
            return
        query.lookup = await self._ask(model, query)
        query.now = self._clock()

    def unindexed(self, query: RouteQuery) -> None:
        """`look_up` where the index is not asked (awaiting nothing, as an entry point
        whose prefill policy reads no index calls it): only the time choosing reads."""
        query.lookup = None
        query.now = self._clock()

    def _indexed_model(self, query: RouteQuery) -> str | None:
        """The model to look the query's prompt up under; None, the reason counted, when
        the index cannot be asked."""
        if query.tokens is None:
            self.fallback(query.missing or "no_tokenizer")
            return None
        if query.namespace.opaque:
            self.fallback("extra_key", "SGLang's KV events do not say a block's extra_key")
            return None
        if self._lookup is None:
            self.fallback("no_index", "neither --indexer-url nor --redis-url is set")
            return None
        model = self._model(query.namespace.model)
        if model is None:
            self.fallback("no_model", "no --model and no prefill advertised its model yet")
        return model

    async def _ask(self, model: str, query: RouteQuery) -> LookupResult | None:
        assert self._lookup is not None, "checked by _indexed_model"
        assert query.tokens is not None, "checked by _indexed_model"
        namespace = query.namespace
        started = self._clock()
        try:
            # Not asyncio.wait_for: a task per lookup, and on Python 3.11 it can lose a
            # cancellation (kvplumbing.tasks).
            async with asyncio.timeout(self._lookup_timeout):
                result = await self._lookup.lookup(
                    model, query.tokens, namespace.lora_name, namespace.cache_salt
                )
        except (IndexUnavailable, TimeoutError) as exc:
            self.fallback("index_unavailable", repr(exc))
            return None
        self._metrics.lookup_latency.observe(self._clock() - started)
        self._metrics.best_hit.observe(max((p.hit_tokens for p in result.pods), default=0))
        return result

    def candidates(
        self,
        role: Role,
        query: RouteQuery,
        avoid: Collection[str] = (),
        kind: Kind | None = None,
        loaded: bool = True,
    ) -> Sequence[Candidate]:
        """Eligible workers of `role` that may serve `query`: of `kind` (else the query's),
        serving its model when workers advertise it and every adapter it names, without
        those to `avoid` unless no other remains; `loaded`: with their load."""
        every = self.pool.candidates(
            role,
            self.loads if loaded else None,
            kind=kind or query.kind,
            model=query.namespace.model,
            adapters=query.namespace.adapters,
        )
        if not avoid:
            return every
        fresh = [c for c in every if c.worker not in avoid]
        return fresh or every

    def plan(self, query: RouteQuery, avoid: Collection[str] = ()) -> RoutePlan:
        """Choose a pair for one attempt, avoiding the workers that failed this request
        while others remain; raises `NoCandidates` naming the empty role."""
        prefill, choice, query = self.choose_prefill(query, avoid)
        decode = self.choose_decode(query, prefill.kind, avoid)
        return self.bind(query, prefill, choice, decode)

    def prefills(
        self,
        query: RouteQuery,
        avoid: Collection[str] = (),
        among: Collection[str] | None = None,
        kind: Kind | None = None,
        loaded: bool = True,
    ) -> Sequence[Candidate]:
        """The prefills `query` may go to: the eligible ones (`candidates`), only those in
        `among` when given, and of those the ones flow control released it for
        (`RouteQuery.within`) while any of them remains (a retry after they failed goes
        elsewhere)."""
        prefills = self.candidates("prefill", query, avoid, kind, loaded)
        if among is not None:
            prefills = [c for c in prefills if c.worker in among]
        within = query.within
        if within is not None:
            prefills = [c for c in prefills if c.worker in within] or prefills
        return prefills

    def choose_prefill(
        self,
        query: RouteQuery,
        avoid: Collection[str] = (),
        among: Collection[str] | None = None,
        kind: Kind | None = None,
    ) -> tuple[Worker, Choice, RouteQuery]:
        """The prefill policy's choice among the prefills `query` may go to (`prefills`: of
        `kind`, when given, else the query's; only those whose id is in `among`, when
        given: an endpoint picker's subset, a sidecar's named prefill), with the query as
        the policy read it (its pending blocks added); raises `NoCandidates`."""
        prefills = self.prefills(query, avoid, among, kind, self.prefill_policy.reads_load)
        if not prefills:
            which = kind or query.kind
            kinds = "" if which is None else f", {which}"
            adapters = query.namespace.adapters
            serving = f", serving {', '.join(sorted(adapters))}" if adapters else ""
            raise NoCandidates(
                f"no prefill worker is available (healthy, circuit closed, ready{kinds}{serving})"
            )
        if query.lookup is not None:
            query = replace(query, pending=self.loads.pending_blocks(query.lookup.keys))
        choice = self.prefill_policy.choose(query, prefills)
        prefill = self.pool.get(choice.worker)
        if prefill is None:
            raise NoCandidates("a chosen worker left the pool")
        return prefill, choice, query

    def choose_decode(
        self,
        query: RouteQuery,
        kind: Kind,
        avoid: Collection[str] = (),
        among: Collection[str] | None = None,
    ) -> Worker:
        """The decode policy's choice among the eligible decodes of `kind` that may serve
        `query` (only those whose id is in `among`, when given); raises `NoCandidates`."""
        decodes = self.candidates("decode", query, avoid, kind, self.decode_policy.reads_load)
        if among is not None:
            decodes = [c for c in decodes if c.worker in among]
        if not decodes:
            adapters = query.namespace.adapters
            serving = f", serving {', '.join(sorted(adapters))}" if adapters else ""
            raise NoCandidates(
                f"no {kind} decode worker is available (healthy, circuit closed{serving})"
            )
        decode = self.pool.get(self.decode_policy.choose(query, decodes).worker)
        if decode is None:
            raise NoCandidates("a chosen worker left the pool")
        return decode

    def bind(self, query: RouteQuery, prefill: Worker, choice: Choice, decode: Worker) -> RoutePlan:
        """The pair's plan: the decision counted, and one room per batch element drawn so
        that, where the prefill follows the room, it selects the DP rank holding the hit."""
        self.record(choice, query)
        directory = prefill.directory
        dp_size = directory.dp_size
        follows = directory.follow_bootstrap_room and dp_size > 1
        wanted = choice.dp_rank
        known = wanted is not None and wanted < dp_size
        dp_rank = wanted if follows and known else None
        pinned = wanted if self._dp_aware and not follows and dp_size > 1 and known else None
        rng, batch = self._rooms, query.batch
        if batch is None:
            rooms = [draw_room(rng, dp_size, dp_rank)]
        else:
            rooms = [draw_room(rng, dp_size, dp_rank) for _ in range(batch)]
        # `query.keys` inline: a property is a call the request path pays for.
        keys = query.lookup.keys if query.lookup is not None else ()
        return RoutePlan(prefill, decode, choice, rooms, keys, pinned_dp_rank=pinned)

    def record(self, choice: Choice, query: RouteQuery, paired: bool = True) -> None:
        """One decision counted: the prefill's outcome (hit, miss, fallback) and, `paired`,
        the decode's (an aggregated worker serves the request whole)."""
        if paired:
            self._decode_decision.inc()
        if choice.fallback is not None or (self.uses_index and query.lookup is None):
            self._prefill_decisions["fallback"].inc()
            return
        self._prefill_decisions["hit" if choice.hit_tokens > 0 else "miss"].inc()
        if query.lookup is not None:
            self._metrics.chosen_hit.observe(choice.hit_tokens)

    def forget(self, worker: str) -> None:
        self.prefill_policy.forget(worker)
        self.decode_policy.forget(worker)
        self.loads.forget(worker)
