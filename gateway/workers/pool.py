"""The worker pools: what the gateway knows about each prefill and decode worker.

Identity. A worker's id is its URL's `host:port`. A prefill worker also has the id of the
*pod* the index knows it by, chosen in this order: the `pod_id` given with it; the
`<pod>` of the `kv@<pod>@<model>` topic its KV events carry (given, or discovered from
its `/server_info` or vLLM's `/kv_event_sources`); else its `host:port`. The gateway
registers the prefill as that pod with the index (indexer API or the shared Redis
registry) once its KV-event endpoints are known, so the indexer subscribes to it.

Bootstrap. `bootstrap_host` is the URL's host; `bootstrap_port` is the port given on the
command line, or None (`--prefill URL none`: the injected port is null and each engine
uses its own). Readiness is read from the bootstrap directory at the given port, else at
the port the worker's `/server_info` advertises; when neither is known the directory is
`unknown` and the worker stays eligible (as with sglang-router, which never reads it) —
`/workers` and the `globalkv_gateway_directory_ready` metric say so.

Kind. The PD protocol the worker speaks (`gateway.settings.base.Kind`): given with it, else
detected by the monitor (`gateway.workers.kinds`); SGLang's until then. A request is paired within
one kind and, when workers advertise their models, within the model it names.

Eligibility (`Worker.eligible`): healthy, circuit not open and, for a prefill, directory
`ready` or `unknown`; a ready directory turns `unreachable` only after the health checks'
failure threshold of unanswered reads in a row. Computed from state the monitor keeps
fresh, once per change of that state (`WorkerPool.candidates` keeps the eligible workers
between requests). `/workers` leads each worker with its `status`, "serving" or
why it gets no traffic: a worker answering its health checks while its circuit is open
is healthy and yet out of traffic, and read as "healthy" alone it looked fine. Each change
of a circuit's state is logged with why.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from gateway.load.tracker import Candidate, LoadTracker
from gateway.requests.namespace import ServedAdapter
from gateway.settings.base import Kind, Role
from gateway.settings.workers import BreakerConfig, HealthConfig, KvEventsSpec, WorkerSpec
from gateway.workers.breaker import BreakerState, CircuitBreaker
from gateway.workers.directory import Directory, DirectoryStatus
from gateway.workers.health import HealthTracker
from kvplumbing.clock import Clock
from kvplumbing.topics import parse_topic

log = logging.getLogger(__name__)


def worker_id(url: str) -> str:
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


_ERROR_CHARS = 300
_KEPT = 16
"""Candidate lists `WorkerPool.candidates` keeps, at most."""


@dataclass(slots=True)
class Worker:
    spec: WorkerSpec
    breaker: CircuitBreaker
    health: HealthTracker
    id: str = ""
    host: str = ""
    directory: Directory = field(default_factory=Directory)
    kv_events: KvEventsSpec | None = None
    served_model: str | None = None
    adapters: dict[str, str] = field(default_factory=dict)
    """The LoRA adapters it serves (name → base model), as its `/v1/models` lists them."""
    engine_block_size: int | None = None
    kv_capacity_tokens: int | None = None
    """Tokens its KV cache holds, summed over its DP ranks, as its /server_info (vLLM: its
    /metrics) says."""
    discovered: bool = False
    """What it advertises of itself has been read (`gateway.workers.advertised`), and is
    not asked again; with a discovery error, it answered with nothing usable."""
    detected_kind: Kind | None = None
    """The kind the monitor found, for a worker given without one."""
    registered_pod: str | None = None
    """The pod id registered with the index, once done."""
    last_error: str | None = None
    """The latest failure seen with it: discovery, pod registration, or a request's call."""
    last_error_at: float | None = None
    last_error_step: str | None = None
    """Which step failed: "call", "discovery" or "registration"."""
    _bare: Candidate | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.id = worker_id(self.spec.url)
        self.host = urlsplit(self.spec.url).hostname or ""
        self.kv_events = self.spec.kv_events
        if self.spec.role == "decode":
            self.directory.status = DirectoryStatus.UNKNOWN
        elif self.spec.bootstrap_port is not None:
            self.directory.port = self.spec.bootstrap_port

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def role(self) -> Role:
        return self.spec.role

    @property
    def pod(self) -> str:
        if self.spec.pod_id:
            return self.spec.pod_id
        parsed = parse_topic(self.kv_events.topic) if self.kv_events else None
        return self.id if parsed is None else parsed[0]

    def bare(self) -> Candidate:
        """The worker as a candidate without load, for a policy that reads none: one object
        kept while its pod and KV capacity stay (a new one per request cost a policy that
        reads only the id as much as choosing)."""
        pod, capacity = self.pod, self.kv_capacity_tokens
        bare = self._bare
        if bare is None or bare.pod != pod or bare.cache_capacity_tokens != capacity:
            bare = self._bare = Candidate(self.id, pod, cache_capacity_tokens=capacity)
        return bare

    @property
    def kind(self) -> Kind:
        if self.spec.kind != "auto":
            return self.spec.kind
        return self.detected_kind or "sglang"

    @property
    def bootstrap_port(self) -> int | None:
        return self.spec.bootstrap_port

    @property
    def eligible(self) -> bool:
        # Read per worker per request: the directory's status by identity (an enum's hash
        # is a Python call), the breaker's clock last.
        status = self.directory.status
        return (
            self.health.healthy
            and (status is DirectoryStatus.READY or status is DirectoryStatus.UNKNOWN)
            and self.breaker.allows()
        )

    def status(self) -> str:
        """ "serving", or "no traffic: " and why, as an operator reads it."""
        reasons = []
        if not self.health.healthy:
            reasons.append(f"health {self.health.state.value}")
        retry = self.breaker.retry_in() if not self.breaker.allows() else None
        if retry is not None:
            reasons.append(f"circuit open for {retry:.0f} s more")
        if self.directory.status not in (DirectoryStatus.READY, DirectoryStatus.UNKNOWN):
            reasons.append(f"directory {self.directory.status.value}")
        if reasons:
            return "no traffic: " + ", ".join(reasons)
        if self.breaker.state is BreakerState.HALF_OPEN:
            return "serving: circuit half-open, on trial"
        return "serving"

    def note_error(self, error: str, now: float, step: str = "call") -> None:
        self.last_error, self.last_error_at = error[:_ERROR_CHARS], now
        self.last_error_step = step

    def step_succeeded(self, step: str) -> None:
        """A background step that failed has now succeeded: its error was a moment's (the
        indexer not listening yet when the gateway came up), not the worker's state, and
        is dropped; shown, it read as a recent problem for minutes (`globalkv doctor`)."""
        if self.last_error_step == step:
            self.last_error = self.last_error_at = self.last_error_step = None

    def describe(self, loads: LoadTracker, now: float) -> dict[str, Any]:
        """What `/workers` shows; `now` on the clock of `note_error`, for the error's age."""
        load = loads.load(self.id)
        stats = self.breaker.stats()
        at = self.last_error_at
        out: dict[str, Any] = {
            "id": self.id,
            "url": self.url,
            "role": self.role,
            "kind": self.kind,
            "kind_detected": self.spec.kind == "auto" and self.detected_kind is not None,
            "served_model": self.served_model,
            "adapters": sorted(self.adapters),
            "status": self.status(),
            "eligible": self.eligible,
            "health": self.health.state.value,
            "circuit": stats.state.value,
            "circuit_retry_in_secs": _rounded(self.breaker.retry_in()),
            "health_error": self.health.last_error,
            "consecutive_failures": stats.consecutive_failures,
            "in_flight": load.in_flight,
            "queued_prefill_tokens": load.queued_prefill_tokens,
            "remaining_prefill_tokens": load.progress.remaining(loads.clock()),
            "prefill_tokens_per_s": load.progress.tokens_per_s,
            "last_error": self.last_error,
            "last_error_age_secs": None if at is None else round(now - at, 1),
            "last_error_step": self.last_error_step,
            "discovered": self.discovered,
        }
        if self.role == "prefill":
            out.update(
                pod=self.pod,
                bootstrap_host=self.host,
                bootstrap_port=self.bootstrap_port,
                directory=self.directory.status.value,
                directory_port=self.directory.port,
                directory_error=self.directory.error,
                dp_size=self.directory.dp_size,
                follow_bootstrap_room=self.directory.follow_bootstrap_room,
                kv_events=self.kv_events.model_dump() if self.kv_events else None,
                registered_pod=self.registered_pod,
            )
        return out


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 1)


@dataclass(frozen=True, slots=True)
class Served:
    """What the pool's workers serve, as a request's namespace is read against."""

    adapters: frozenset[ServedAdapter]
    models: frozenset[str]
    """The base models the workers advertise."""
    prefill_models: tuple[str, ...]
    """The models the prefills advertise, in the order the prefills came."""


class DuplicateWorker(ValueError):
    pass


class WorkerPool:
    """Workers by id; the admin API and the CLI add them, the monitor keeps them fresh."""

    def __init__(self, breaker: BreakerConfig, health: HealthConfig, clock: Clock) -> None:
        self._breaker = breaker
        self._health = health
        self._clock = clock
        self._workers: dict[str, Worker] = {}
        self._roles: dict[Role, list[Worker]] = {"prefill": [], "decode": []}
        """The same workers by role: the request path reads these lists."""
        self._served: Served | None = None
        """`served()`, until a worker comes, goes or changes."""
        self._bare: dict[tuple[Role, Kind | None, str | None], tuple[Candidate, ...]] = {}
        """The eligible workers without adapters named, as bare candidates, by (role, kind,
        model), until a worker comes, goes or changes in what they were read from
        (`changed`)."""

    def add(self, spec: WorkerSpec) -> Worker:
        name = f"{spec.role} {worker_id(spec.url)}"

        def transition(before: BreakerState, after: BreakerState, why: str) -> None:
            self._bare.clear()
            level = logging.WARNING if after is BreakerState.OPEN else logging.INFO
            log.log(level, "%s: circuit %s → %s (%s)", name, before.value, after.value, why)

        breaker = CircuitBreaker(self._breaker, self._clock, transition)
        worker = Worker(spec, breaker, HealthTracker(self._health, self._bare.clear))
        if worker.id in self._workers:
            raise DuplicateWorker(f"a worker at {worker.id} is already in the pool")
        self._workers[worker.id] = worker
        self._roles[worker.role] = [*self._roles[worker.role], worker]
        self.changed()
        return worker

    def remove(self, worker_id: str) -> Worker | None:
        worker = self._workers.pop(worker_id, None)
        if worker is not None:
            self._roles[worker.role] = [w for w in self._roles[worker.role] if w is not worker]
            self.changed()
        return worker

    def get(self, worker_id: str) -> Worker | None:
        return self._workers.get(worker_id)

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self._workers.values()))

    def role(self, role: Role) -> list[Worker]:
        return list(self._roles[role])

    def served(self) -> Served:
        """Every LoRA adapter some worker serves (with its base model and engine) and the
        base models the workers advertise: asked per request, built again only after a
        worker came, went or `changed`."""
        if self._served is None:
            workers = self._workers.values()
            adapters = frozenset(
                ServedAdapter(name, base, w.kind)
                for w in workers
                for name, base in w.adapters.items()
            )
            prefills = tuple(w.served_model for w in self._roles["prefill"] if w.served_model)
            models = frozenset(w.served_model for w in workers if w.served_model)
            self._served = Served(adapters, models, prefills)
        return self._served

    def changed(self) -> None:
        """A worker came or went, or what choosing reads of one changed besides its health
        and circuit (which tell the pool themselves): its kind, model, adapters, directory
        status, pod or KV capacity (the monitor found them)."""
        self._served = None
        self._bare.clear()

    def eligible(self, role: Role) -> list[Worker]:
        return [w for w in self._roles[role] if w.eligible]

    def candidates(
        self,
        role: Role,
        loads: LoadTracker | None,
        *,
        kind: Kind | None = None,
        model: str | None = None,
        adapters: Collection[str] = (),
    ) -> Sequence[Candidate]:
        """The eligible workers of `role`; of `kind` when given; serving every one of
        `adapters`; and, when `model` is given and some of them advertise it, those only (a
        model no worker advertises, as a client's placeholder name, is served by any).

        Without `adapters`, the workers are kept until what they were read from changes, as
        bare candidates (id, pod, capacity), and only a policy's `loads` are read per
        request: reading them per request was half of choosing a pair's instructions
        (docs/gateway-design.md). Not while a circuit of the role is open (it lets requests
        through again by the clock, not by an event); a few kept, as clients name models."""
        if adapters:
            workers = self._serving(role, kind, model, adapters)
            if loads is None:
                return [w.bare() for w in workers]
            return [
                loads.candidate(w.id, w.pod, capacity_tokens=w.kv_capacity_tokens) for w in workers
            ]
        key = (role, kind, model)
        kept = self._bare.get(key)
        if kept is None:
            kept = tuple(w.bare() for w in self._serving(role, kind, model, adapters))
            if not any(w.breaker.opened for w in self._roles[role]):
                if len(self._bare) >= _KEPT:
                    self._bare.clear()
                self._bare[key] = kept
        if loads is None:
            return kept
        return [
            loads.candidate(c.worker, c.pod, capacity_tokens=c.cache_capacity_tokens) for c in kept
        ]

    def _serving(
        self, role: Role, kind: Kind | None, model: str | None, adapters: Collection[str]
    ) -> list[Worker]:
        workers = [
            w
            for w in self._roles[role]
            if w.eligible
            and (kind is None or w.kind == kind)
            and (not adapters or all(a in w.adapters for a in adapters))
        ]
        if model is not None:
            serving = [w for w in workers if w.served_model == model]
            if serving:
                workers = serving
        return workers
