"""Each worker's load as this gateway sees it: requests in flight, prefill work queued,
and the prompts sent to each prefill that the index may not show yet.

It changes through one verb per event, each with one ticket per request and worker, so
finishing twice cannot corrupt it: `start_prefill` (a prompt sent to the worker a policy
chose to prefill it: in flight, its uncached tokens queued, its block keys pending on the DP
rank computing them), `start_decode` (in flight only), `move` (a request served by another
worker than the one chosen: in flight there only), `prefill_done` (the prompt's KV
computed, or not) and `finish`. The legs, the endpoint picker and the simulator call them
alike; the policies read the load through the `Candidate` snapshots it makes. Other gateway
replicas' loads join it through a `SharedView` when they share them.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gateway.load.pending import PendingEntry, PendingHit, PendingPrefixes
from gateway.load.progress import PrefillProgress
from kvplumbing.clock import Clock


# Built several times per request, so not frozen and with its own __init__ (see
# `gateway.policies.base`): treat it as read-only all the same.
@dataclass(slots=True, init=False)
class Candidate:
    worker: str
    """The worker's id (stable for its lifetime in the pool)."""
    pod: str
    """The pod id the index names this worker by (decodes: equal to the worker id)."""
    in_flight: int
    """Requests sent to it and not finished."""
    queued_prefill_tokens: int
    """Prompt tokens it was asked to prefill (beyond its cache) that it has not finished."""
    remaining_prefill_tokens: int
    """The work it is estimated to have left of those, in tokens at its average rate: a
    prompt after a long cached context counts for more than its tokens
    (`gateway.load.progress`)."""
    cache_capacity_tokens: int | None
    """Tokens its KV cache holds, as the engine reports them; None: not reported."""

    def __init__(
        self,
        worker: str,
        pod: str,
        in_flight: int = 0,
        queued_prefill_tokens: int = 0,
        remaining_prefill_tokens: int = 0,
        cache_capacity_tokens: int | None = None,
    ) -> None:
        self.worker = worker
        self.pod = pod
        self.in_flight = in_flight
        self.queued_prefill_tokens = queued_prefill_tokens
        self.remaining_prefill_tokens = remaining_prefill_tokens
        self.cache_capacity_tokens = cache_capacity_tokens


@dataclass(slots=True)
class WorkerLoad:
    in_flight: int = 0
    progress: PrefillProgress = field(default_factory=PrefillProgress)

    @property
    def queued_prefill_tokens(self) -> int:
        return self.progress.open_tokens


# Built per request: its own __init__, compiled where the module is (the dataclass gives
# eq and repr only; its generated __init__ runs interpreted): docs/gateway-design.md.
@dataclass(slots=True, init=False)
class LoadTicket:
    """One request's share of one worker's load, so finishing it twice cannot corrupt it."""

    worker: str
    load: WorkerLoad
    serial: int
    prefill_open: bool
    open: bool
    pending: PendingEntry | None

    def __init__(
        self,
        worker: str,
        load: WorkerLoad,
        serial: int,
        prefill_open: bool = True,
        open: bool = True,
        pending: PendingEntry | None = None,
    ) -> None:
        self.worker = worker
        self.load = load
        self.serial = serial
        self.prefill_open = prefill_open
        self.open = open
        self.pending = pending


class PrefillChoice(Protocol):
    """A policy's choice of the worker to prefill a prompt (`gateway.policies.base.Choice`):
    what of the prompt it is expected to hold and what to compute."""

    worker: str
    hit_tokens: int
    uncached_tokens: int


class SharedView(Protocol):
    """What other gateway replicas published (`gateway.replicas.shared_state`): added to this
    gateway's own view, and told what this one sends."""

    def load(self, worker: str) -> tuple[int, int, int]:
        """The others' (in flight, queued prefill tokens, remaining tokens) on `worker`."""
        ...

    def pending(self, keys: Sequence[int], now: float) -> Mapping[str, PendingHit]: ...

    def sent(self, serial: int, worker: str, keys: Sequence[int], dp_rank: int | None) -> None: ...

    def answered(self, serial: int, computed: bool) -> None: ...


@dataclass(slots=True)
class LoadTracker:
    """Per-worker load that the legs (or a simulator) update through explicit hooks,
    and the prompts sent to each prefill that the index may not show yet.

    `clock` is the one `RouteQuery.now` is read from (the simulator gives its own)."""

    loads: dict[str, WorkerLoad] = field(default_factory=dict)
    pending: PendingPrefixes | None = field(default_factory=PendingPrefixes)
    """None: nothing is counted as pending (`--prefix-pending-grace-secs off`)."""
    clock: Clock = time.monotonic
    shared: SharedView | None = None
    """Other replicas' loads and pending prompts, when they share them."""
    _serials: Iterator[int] = field(default_factory=itertools.count, repr=False)

    def start_prefill(
        self, choice: PrefillChoice, keys: Sequence[int] = (), dp_rank: int | None = None
    ) -> LoadTicket:
        """A prompt sent to the worker `choice` names to prefill: its uncached tokens
        queued there after the tokens it is expected to hold (their context, which makes
        them dearer), and `keys`, the prompt's block keys, held as pending there (on
        `dp_rank`, when known: `gateway.routing.plan.RoutePlan.dp_rank`) until its prefill
        ends."""
        worker, uncached = choice.worker, choice.uncached_tokens
        load = self._load(worker)
        load.in_flight += 1
        serial = next(self._serials)
        if uncached > 0:
            load.progress.sent(serial, uncached, self.clock(), choice.hit_tokens)
        pending = self.pending.add(worker, keys, dp_rank) if keys and self.pending else None
        if pending is not None and self.shared is not None:
            self.shared.sent(serial, worker, keys, dp_rank)
        return LoadTicket(worker, load, serial, prefill_open=uncached > 0, pending=pending)

    def start_decode(self, worker: str) -> LoadTicket:
        """A request sent to `worker` that prefills nothing there: in flight only."""
        load = self._load(worker)
        load.in_flight += 1
        return LoadTicket(worker, load, next(self._serials), prefill_open=False)

    def _load(self, worker: str) -> WorkerLoad:
        """The worker's load, made at its first request (not with `setdefault`, which
        would build one, with its progress and fit, per request only to drop it)."""
        load = self.loads.get(worker)
        if load is None:
            load = self.loads[worker] = WorkerLoad()
        return load

    def move(self, ticket: LoadTicket, worker: str) -> LoadTicket:
        """The request `ticket` holds was served by `worker` instead (an endpoint picker's
        fallback): `ticket` ends, its prompt not computed where it was sent, and the
        request is in flight on `worker` only, what it prefills there unknown."""
        self.finish(ticket, computed=False)
        return self.start_decode(worker)

    def pending_blocks(self, keys: Sequence[int]) -> Mapping[str, PendingHit]:
        if self.pending is None:
            return {}
        own = self.pending.depths(keys, self.clock())
        if self.shared is None:
            return own
        merged = dict(own)
        for worker, hit in self.shared.pending(keys, self.clock()).items():
            if worker not in merged or hit.blocks > merged[worker].blocks:
                merged[worker] = hit
        return merged

    def pending_keys(self) -> int:
        """Keys in the pending table now (the metric), entries past their grace dropped."""
        if self.pending is None:
            return 0
        self.pending.expire(self.clock())
        return self.pending.keys

    def prefill_done(self, ticket: LoadTicket, computed: bool = True, timed: bool = True) -> None:
        """`computed`: the prefill answered with success, so it holds the prompt's KV;
        `timed`: its answer came when the prefill ended, so it times the worker's rate (a
        decode's whole answer, which came with its last token, does not)."""
        if ticket.prefill_open:
            ticket.prefill_open = False
            ticket.load.progress.answered(ticket.serial, self.clock(), computed and timed)
        if ticket.pending is not None and self.pending is not None:
            if self.shared is not None:
                self.shared.answered(ticket.serial, computed)
            if computed:
                self.pending.settle(ticket.pending, self.clock())
            else:
                self.pending.drop(ticket.pending)
            ticket.pending = None

    def finish(self, ticket: LoadTicket, computed: bool = True, timed: bool = True) -> None:
        self.prefill_done(ticket, computed, timed)
        if ticket.open:
            ticket.open = False
            ticket.load.in_flight -= 1

    def forget(self, worker: str) -> None:
        """A removed worker; tickets still open on it update a load nobody reads."""
        self.loads.pop(worker, None)
        if self.pending is not None:
            self.pending.forget(worker)

    def load(self, worker: str) -> WorkerLoad:
        return self.loads.get(worker) or WorkerLoad()

    def candidate(
        self,
        worker: str,
        pod: str | None = None,
        now: float | None = None,
        capacity_tokens: int | None = None,
    ) -> Candidate:
        load = self.loads.get(worker)
        if load is None:
            candidate = Candidate(worker, pod or worker, cache_capacity_tokens=capacity_tokens)
        else:
            progress = load.progress
            remaining = 0
            if progress.open:  # read per worker per request: no clock while nothing is open
                remaining = progress.remaining(self.clock() if now is None else now)
            candidate = Candidate(
                worker,
                pod or worker,
                load.in_flight,
                progress.open_tokens,
                remaining,
                capacity_tokens,
            )
        if self.shared is not None:
            in_flight, queued, remaining = self.shared.load(worker)
            candidate.in_flight += in_flight
            candidate.queued_prefill_tokens += queued
            candidate.remaining_prefill_tokens += remaining
        return candidate

    def candidates(
        self,
        workers: Iterable[str | tuple[str, str]],
        capacity_tokens: Mapping[str, int] | None = None,
    ) -> list[Candidate]:
        """Snapshots of workers given as ids or (id, pod) pairs; `capacity_tokens`: the KV
        capacity each worker reported, by worker id."""
        now = self.clock()
        capacities = capacity_tokens or {}
        out: list[Candidate] = []
        for item in workers:
            worker, pod = (item, item) if isinstance(item, str) else item
            out.append(self.candidate(worker, pod, now, capacities.get(worker)))
        return out
