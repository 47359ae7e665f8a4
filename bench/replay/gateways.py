"""The replay through several gateways: the trace's requests split over G gateway replicas.

Each replica is the gateway's own objects with its own state — prefill and decode policy
(each seeded `seed + g`), `LoadTracker` and pending-prompt table — behind a load balancer
that sends request i to replica i mod G. The index is shared, as every gateway reads the
same Redis; each replica reads the prefills' capacities, as each gateway reads them from
the engines, and keeps its own placement ledger (the pressure cost's record). What the
replicas share besides the index is `gateway_sharing`:

- `none`: nothing; each sees only the load it put on the pods and the prompts it sent
  (today's gateway, run several times over).
- `shared`: each replica publishes what its choices depend on besides the index every
  `share_interval_s` (trace seconds): per prefill, its requests in flight, queued prefill
  tokens and remaining-work estimate, and the prompts it sent but the index may not show
  yet (added, settled, dropped). The others add what they last received to their own view:
  the loads of the latest publication at or before `now` (so at most one interval old),
  and each pending-table change one interval after it happened. That interval is the
  staleness bound of the sharing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from random import Random
from typing import Literal

from bench.replay.events import EventKind, InFlight
from bench.replay.record import RunRecord
from bench.replay.sim import Run, Simulation
from bench.replay.tokens import expand
from bench.replay.trace import conversation
from gateway.load.pending import PendingEntry, PendingHit, PendingPrefixes
from gateway.load.tracker import Candidate, LoadTicket, LoadTracker
from gateway.policies import Policy, build_policy
from gateway.requests.query import RouteQuery

Sharing = Literal["none", "shared"]


@dataclass(slots=True)
class _Change:
    at: float
    origin: int
    serial: int
    """The origin's ticket serial: names the entry across replicas."""
    kind: Literal["add", "settle", "drop"]
    worker: str = ""
    keys: tuple[int, ...] = ()


@dataclass(slots=True)
class _Replica:
    number: int
    policy: Policy
    decode_policy: Policy
    loads: LoadTracker
    remote: PendingPrefixes | None
    """The others' pending prompts as received (None: no pending table)."""
    remote_entries: dict[tuple[int, int], PendingEntry] = field(default_factory=dict)
    received: int = 0
    """Changes of the shared log applied to `remote` so far."""
    published: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    published_at: float = -1.0


class _SharedRun(Run):
    """`Run` with the routing of each request done by one of several replicas."""

    def __init__(self, sim: GatewaysSimulation, started_wall: float) -> None:
        super().__init__(sim, started_wall)
        settings, scale = sim.settings, sim.settings.time_scale
        self.sharing: Sharing = settings.gateway_sharing
        self.interval = settings.share_interval_s * scale
        grace = settings.prefix.pending_grace_secs
        self.replicas = []
        for g in range(settings.gateways):
            rng = Random(settings.seed + g)
            prefix, cache_aware = settings.prefix, settings.cache_aware
            policy = build_policy(sim.policy_name, rng, prefix=prefix, cache_aware=cache_aware)
            table = None if grace is None else PendingPrefixes(grace * scale)
            remote = None if grace is None else PendingPrefixes(grace * scale)
            loads = LoadTracker(pending=table, clock=self.clock.read)
            decode = build_policy(settings.decode_policy, rng)
            self.replicas.append(_Replica(g, policy, decode, loads, remote))
        self.log: list[_Change] = []
        self.routed_by: dict[int, tuple[_Replica, LoadTicket]] = {}

    async def handle(self, now: float, kind: EventKind, payload: object) -> None:
        if kind is EventKind.ANSWERED:
            assert isinstance(payload, int)
            replica, ticket = self.routed_by[payload]
            self._settled(replica, ticket, now)
            replica.loads.finish(self.flights[payload].prefill)
        elif kind is EventKind.DECODED:
            assert isinstance(payload, int)
            replica, _ = self.routed_by.pop(payload)
            flight = self.flights.pop(payload)
            replica.loads.finish(flight.decode)
            self.record.decoded(payload, now)
        else:
            await super().handle(now, kind, payload)

    async def arrive(self, i: int, now: float) -> None:
        replica = self.replicas[i % len(self.replicas)]
        req, settings = self.requests[i], self.settings
        tokens = expand(req.hash_ids, req.input_length, self.sim.cluster.block_size, settings.vocab)
        uses_index = replica.policy.uses_index
        answer = await self.lookup.lookup(settings.model, tokens) if uses_index else None
        keys = () if answer is None else answer.keys
        pending = self._pending(replica, keys, now)
        session = conversation(req) if settings.sessions else None
        request = RouteQuery(
            tokens=tokens, lookup=answer, now=now, pending=pending, session=session
        )
        choice = replica.policy.choose(request, self._candidates(replica, self.prefills, now))
        decodes = self._candidates(replica, self.decodes, now)
        decode = replica.decode_policy.choose(request, decodes).worker
        ticket = replica.loads.start_prefill(choice, keys)
        if ticket.pending is not None and ticket.pending.first is not None:
            self._publish(replica, ticket, "add", now, tuple(keys))
        flight = InFlight(
            ticket, replica.loads.start_decode(decode), settings.output_tokens(req.output_length)
        )
        self.flights[i] = flight
        self.routed_by[i] = (replica, ticket)
        indexed = None if answer is None else max((p.hit_tokens for p in answer.pods), default=0)
        self.record.routed(
            i, now, choice, tokens=len(tokens), output=flight.output_length, indexed_hit=indexed
        )
        pod = self.sim.pods[choice.worker]
        pod.admit(i, tokens, now)
        self.events.push(now, EventKind.KICK, pod)

    # ---------------------------------------------------------------- sharing

    def _publish(
        self, replica: _Replica, ticket: LoadTicket, kind: Literal["add", "settle", "drop"],
        now: float, keys: tuple[int, ...] = (),
    ) -> None:  # fmt: skip
        if self.sharing == "shared":
            change = _Change(now, replica.number, ticket.serial, kind, ticket.worker, keys)
            self.log.append(change)

    def _settled(self, replica: _Replica, ticket: LoadTicket, now: float) -> None:
        if ticket.pending is not None and ticket.pending.first is not None:
            self._publish(replica, ticket, "settle", now)

    def _receive(self, replica: _Replica, now: float) -> None:
        """Apply the others' pending-table changes one interval old or older."""
        log, remote = self.log, replica.remote
        while replica.received < len(log) and log[replica.received].at + self.interval <= now:
            change = log[replica.received]
            replica.received += 1
            if change.origin == replica.number or remote is None:
                continue
            key = (change.origin, change.serial)
            if change.kind == "add":
                replica.remote_entries[key] = remote.add(change.worker, change.keys)
                continue
            added = replica.remote_entries.pop(key, None)
            if added is not None:  # a settle keeps it held for the grace, as the origin does
                remote.settle(added, change.at + self.interval)

    def _pending(self, replica: _Replica, keys: Sequence[int], now: float) -> dict[str, PendingHit]:
        own = dict(replica.loads.pending_blocks(keys))
        if self.sharing == "none" or replica.remote is None or not keys:
            return own
        self._receive(replica, now)
        for worker, hit in replica.remote.depths(keys, now).items():
            mine = own.get(worker)
            if mine is None or hit.blocks > mine.blocks:
                own[worker] = hit
        return own

    def _candidates(self, replica: _Replica, workers: list[str], now: float) -> list[Candidate]:
        mine = replica.loads.candidates(workers, self.capacities)
        if self.sharing == "none":
            return mine
        for other in self.replicas:
            if other is replica:
                continue
            loads = self._publication(other, workers, now)
            for candidate in mine:
                in_flight, queued, remaining = loads.get(candidate.worker, (0, 0, 0))
                candidate.in_flight += in_flight
                candidate.queued_prefill_tokens += queued
                candidate.remaining_prefill_tokens += remaining
        return mine

    def _publication(
        self, replica: _Replica, workers: list[str], now: float
    ) -> dict[str, tuple[int, int, int]]:
        """`replica`'s loads as of its latest publication (every interval, at its multiples),
        read from its state when first asked for after it: at most one interval old."""
        latest = now if self.interval == 0 else (now // self.interval) * self.interval
        if replica.published_at < latest or self.interval == 0:
            snapshot = replica.loads.candidates(workers)
            replica.published.update(
                {
                    c.worker: (c.in_flight, c.queued_prefill_tokens, c.remaining_prefill_tokens)
                    for c in snapshot
                }
            )
            replica.published_at = latest
        return replica.published


@dataclass(slots=True)
class GatewaysSimulation(Simulation):
    """`Simulation` with the requests split over `settings.gateways` replicas."""

    async def run(self) -> RunRecord:
        replay = _SharedRun(self, time.perf_counter())
        await replay.run_to_end()
        self.report_progress(replay.total, replay)
        return replay.record
