"""Choosing the endpoint for one request behind Envoy, with the gateway's own parts.

The picker is the gateway's choice without the gateway's calls: the same `Router` (index
lookup, prefill and decode policies, decisions counted), the same `WorkerPool` (health,
breakers, discovery kept fresh by the monitor) and the same `LoadTracker` (in flight,
prefill work queued, prompts sent but not yet indexed, shared with other replicas through
Redis when `--share-state-interval-secs` is set), so an endpoint picker and a gateway on
one Redis see one cluster and choose alike.

Two shapes of pool:

- aggregated (`--worker URL`): each worker serves whole requests; it is the prefill
  policy's choice (it holds the KV cache the index knows), and Envoy sends it the request;
- PD (`--prefill`/`--decode`, the decodes being their sidecars' addresses): the prefill
  policy chooses the prefill, the decode policy the decode; Envoy sends the request to the
  decode's sidecar, which binds it to the prefill named in `x-globalkv-prefill` (and
  llm-d's `x-prefiller-host-port`).

The load a pick starts is held until the response ends (`Pick.release`), the prefill's
part until the response's headers arrive (the prefill's work is done by then: its decode
answered). Fallback endpoints (`fallbacks`) are the other eligible endpoints, least
loaded first.

A request comes in as it comes into the gateway, by the same sequence
(`gateway.serving.intake`): read, admitted, looked up in the index (under flow control
also before, and again when it waited), then picked. Admission control
(`--max-concurrent-requests` and its queue) holds a place until the response ends; with
`--flow-control` instead an inference request waits for its turn in the flow queues
(`gateway.flow`), its flow read from the request's headers as the gateway reads them, and
holds its place until the response ends: the picker sees every request of the pool (a
decode's sidecar behind it sees only its own), so it is where flow control belongs. Envoy
holds the request meanwhile: told when the request starts waiting in a queue, it waits for
the pick up to `wait_secs` instead of its ext_proc message timeout (`gateway.epp.stream`)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field

from gateway.epp.protocol import Headers, RequestHeaders
from gateway.http.answer import Answer, problem
from gateway.load.tracker import LoadTicket, LoadTracker
from gateway.policies.base import NoCandidates
from gateway.requests.headers import LLMD_PREFILL_HEADER, PREFILL_HEADER
from gateway.requests.query import RouteQuery
from gateway.routing.plan import RoutePlan
from gateway.routing.router import Router
from gateway.serving.intake import Intake, Place
from gateway.serving.service import Gateway
from gateway.settings.base import Kind, Role
from gateway.workers.pool import Worker

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Pick:
    """An endpoint chosen for one request, and the load it holds until `release`."""

    endpoints: list[str]
    """Best first: the primary, then fallbacks."""
    headers: Headers
    """Request headers to set (the prefill a sidecar binds to)."""
    tickets: list[LoadTicket] = field(default_factory=list)
    prefill: LoadTicket | None = None
    """The prefill's share of the load, settled when the response's headers arrive."""
    place: Place | None = None
    """Its place under flow control or admission control, held until the response ends."""


class Picker:
    def __init__(
        self, gateway: Gateway, *, fallbacks: int = 0, shed_in_flight: int | None = None
    ) -> None:
        self._gateway = gateway
        self._router: Router = gateway.router
        self._loads: LoadTracker = gateway.loads
        self._fallbacks = fallbacks
        self._shed = shed_in_flight
        self.draining = False
        """Stopping: not ready, so the data plane opens no new stream here. Nothing else
        makes the picker unready: with no eligible endpoint each request is answered 503."""
        self._intake = Intake(gateway)
        limits = gateway.config.admission
        self.wait_secs = limits.queue_timeout_secs + gateway.config.lookup_timeout_secs + 1.0
        """The longest a pick takes once its request starts waiting in a queue: the wait
        itself, a lookup in the index again, a second to spare."""
        names = {name.decode() for name in self._intake.reader.header_names}
        flow = gateway.flow is not None
        self.headers = RequestHeaders({*names, "authorization"} if flow else names)
        """Reads the request headers `pick` reads: what the reader reads (sessions, flow
        control's) and, with flow control, the API key (a tenant without a header)."""

    @property
    def disaggregated(self) -> bool:
        """Decodes in the pool: Envoy sends to a decode's sidecar, naming the prefill."""
        return bool(self._gateway.pool.role("decode"))

    async def pick(
        self,
        path: str,
        body: bytes,
        subset: Collection[str] | None,
        headers: Mapping[str, str] | None = None,
        waiting: Callable[[], Awaitable[None]] | None = None,
    ) -> Pick | Answer:
        """The endpoint for a request of `body` to `path`, among `subset` when given, or
        the refusal to answer instead, as the gateway answers the same refusal: the one
        place a request enters the picker, so admission can wrap it. `headers`: what
        `self.headers` read of the request's (lower-case names). `waiting` is awaited when
        the request starts waiting in a queue; the pick then comes within `wait_secs`."""
        given = headers or {}
        picked = {name.encode(): value.encode("latin-1") for name, value in given.items()}
        prefills = None if self.disaggregated else subset  # a PD subset bounds the decodes
        admitted = await self._intake.admit(
            path.partition("?")[0], body, picked, given.get("authorization"), waiting, prefills
        )
        if isinstance(admitted, Answer):
            return admitted
        place = admitted.place
        try:
            pick = self._pair if self.disaggregated else self._whole
            chosen = pick(admitted.query, subset)
        except NoCandidates as exc:
            refusal = problem(503, str(exc), "no_available_workers")
        except _Shed as exc:
            refusal = problem(429, str(exc), "overloaded")
        else:
            chosen.place = place
            return chosen
        if place is not None:
            place.release()
        return refusal

    def _whole(self, query: RouteQuery, subset: Collection[str] | None) -> Pick:
        among = self._open("prefill", query.kind, subset)
        worker, choice, query = self._router.choose_prefill(query, among=among)
        self._router.record(choice, query, paired=False)
        pick = Pick(self._endpoints(worker, "prefill", subset), ())
        # An aggregated worker is both halves of its pair.
        pick.prefill = self._start_prefill(RoutePlan(worker, worker, choice, [], query.keys))
        pick.tickets.append(pick.prefill)
        return pick

    def _pair(self, query: RouteQuery, subset: Collection[str] | None) -> Pick:
        prefill, choice, query = self._router.choose_prefill(query)
        among = self._open("decode", prefill.kind, subset)
        decode = self._router.choose_decode(query, prefill.kind, among=among)
        self._router.record(choice, query)
        headers = ((PREFILL_HEADER, prefill.id), (LLMD_PREFILL_HEADER, prefill.id))
        pick = Pick(self._endpoints(decode, "decode", subset), headers)
        pick.prefill = self._start_prefill(RoutePlan(prefill, decode, choice, [], query.keys))
        pick.tickets += [pick.prefill, self._loads.start_decode(decode.id)]
        return pick

    def _open(
        self, role: Role, kind: Kind | None, subset: Collection[str] | None
    ) -> Collection[str] | None:
        """The endpoints that may be chosen: those of `subset` with room, when shedding
        (`NoCandidates` follows when the subset holds no eligible one, `_Shed` when each
        eligible one has `shed_in_flight` requests in flight)."""
        if self._shed is None:
            return subset
        candidates = [
            c
            for c in self._gateway.pool.candidates(role, self._loads, kind=kind)
            if subset is None or c.worker in subset
        ]
        room = {c.worker for c in candidates if c.in_flight < self._shed}
        if candidates and not room:
            raise _Shed(f"every endpoint has {self._shed} or more requests in flight")
        return room

    def _start_prefill(self, plan: RoutePlan) -> LoadTicket:
        """The load of the plan's prefill as the legs start it (`PairCalls.prefill_load`).
        The plan has no rooms: the decode's sidecar draws them, so a prefill following the
        room has no known DP rank here."""
        return self._loads.start_prefill(plan.prefill_choice, plan.keys, plan.dp_rank)

    def _endpoints(self, chosen: Worker, role: Role, subset: Collection[str] | None) -> list[str]:
        if not self._fallbacks:
            return [chosen.id]
        others = [
            c
            for c in self._gateway.pool.candidates(role, self._loads, kind=chosen.kind)
            if c.worker != chosen.id and (subset is None or c.worker in subset)
        ]
        others.sort(key=lambda c: c.in_flight)
        return [chosen.id, *(c.worker for c in others[: self._fallbacks])]

    def served(self, pick: Pick, endpoint: str) -> None:
        """A fallback served the request: the load moves from the primary to it."""
        if endpoint == pick.endpoints[0] or self._gateway.pool.get(endpoint) is None:
            return
        moved = pick.tickets.pop()
        ticket = self._loads.move(moved, endpoint)
        pick.tickets.append(ticket)
        if moved is pick.prefill:
            pick.prefill = ticket

    def answered(self, pick: Pick, status: int) -> None:
        """The response's headers arrived: the prefill's work is over."""
        if pick.prefill is not None:
            self._loads.prefill_done(pick.prefill, computed=status < 300)
        if pick.place is not None:
            pick.place.started()

    def release(self, pick: Pick, succeeded: bool) -> None:
        """The response ended (or the stream closed): every load the pick held ends. The
        prefill's part, unless the response's headers settled it, ends here too, untimed:
        this moment is the response's end, not the prefill's."""
        for ticket in pick.tickets:
            self._loads.finish(ticket, computed=succeeded, timed=False)
        pick.tickets.clear()
        if pick.place is not None:
            pick.place.release()


class _Shed(Exception):
    pass
