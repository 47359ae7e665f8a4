"""Keeping worker state fresh in the background, never on the request path.

One loop per gateway. For each worker, when due:
- health: `GET <url><endpoint>` (sglang-router's check: every `interval_secs`, every
  `startup_check_interval_secs` until first seen healthy, `timeout_secs` each);
- the worker's kind, once it answers, when it was given without one (`gateway.workers.kinds`);
- the LoRA adapters it serves, from its `/v1/models`, with each health check it passes
  (adapters load and unload while an engine runs);
- discovery, once it answers: what it advertises of itself (`gateway.workers.advertised`):
  its KV-event endpoints, served model, block size and KV capacity, and a prefill's DP
  size and bootstrap port, from `/server_info`, or for vLLM from `/kv_event_sources` and
  `/metrics`;
- registration of the worker as a pod with the index, with its role, once its KV-event
  endpoint is known: a decode that publishes KV events (a vLLM decode keeps what it pulled
  and computed) is indexed like a prefill, so a lookup says what each decode holds
  (`gateway.routing.decider`); and registration again whenever the index's pod list (read
  every `registration_check_secs`) no longer holds it: an indexer keeping its pods in
  memory forgets them when it restarts, and nothing else would tell the gateway, whose
  prefix routing would stay off in silence;
- the bootstrap directory's readiness and topology (dp_size, follow_bootstrap_room) via the
  `bootstrap/` control-plane reader, every `directory_refresh_secs`.
`run_once(force=True)` does every check now; tests and start-up await it. A round that
fails unexpectedly is logged and the loop goes on: a monitor that died would leave every
worker's state frozen, silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

import httpx

from gateway.http.connections import LocalResourceError
from gateway.settings.workers import HealthConfig, KvEventsSpec
from gateway.workers.advertised import Retry, read_advertised
from gateway.workers.directory import DirectoryStatus
from gateway.workers.health import Health
from gateway.workers.kinds import detect_kind, read_adapters
from gateway.workers.pool import Worker, WorkerPool
from gateway.workers.server_info import int_or_none
from kvplumbing.clock import Clock, Sleep
from kvplumbing.tasks import cancel_and_wait

log = logging.getLogger(__name__)


class DirectoryReading(Protocol):
    """What the monitor reads of a `bootstrap.reader.DirectoryReport`."""

    @property
    def reachable(self) -> bool: ...
    @property
    def ready(self) -> bool: ...
    @property
    def topology(self) -> dict[str, Any] | None: ...
    @property
    def registered(self) -> int: ...
    @property
    def expected(self) -> int | None: ...
    @property
    def error(self) -> str | None: ...


class DirectoryProbe(Protocol):
    async def read(self, bootstrap_url: str) -> DirectoryReading: ...


@dataclass(frozen=True, slots=True)
class PodRegistration:
    """A prefill or decode pod as the index's registry stores it."""

    id: str
    model: str | None
    block_size: int | None
    role: str
    url: str
    bootstrap_host: str
    bootstrap_port: int | None
    kv_events: KvEventsSpec
    dp_size: int


class RegistrationFailed(RuntimeError):
    """A pod could not be registered or unregistered; the message says why."""


class PodRegistrar(Protocol):
    async def register(self, pod: PodRegistration) -> None:
        """Raises `RegistrationFailed`; the monitor retries on its next round."""
        ...

    async def unregister(self, pod_id: str) -> None:
        """Raises `RegistrationFailed`."""
        ...

    async def listed(self) -> set[str]:
        """The ids of the pods the index knows now; raises `RegistrationFailed`."""
        ...


class Monitor:
    def __init__(
        self,
        pool: WorkerPool,
        client: httpx.AsyncClient,
        config: HealthConfig,
        probe: DirectoryProbe | None,
        registrar: PodRegistrar | None,
        clock: Clock,
        *,
        model: str | None = None,
        block_size: int | None = None,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self.pool = pool
        self._client = client
        self._config = config
        self._probe = probe
        self._registrar = registrar
        self._clock = clock
        self._model = model
        self._block_size = block_size
        self._sleep = sleep
        self._next_health: dict[str, float] = {}
        self._next_directory: dict[str, float] = {}
        self._next_listing = 0.0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def served_model(self, named: str | None = None) -> str | None:
        """The configured model; else `named` (a request's) when a prefill advertises it,
        so a gateway in front of pools of several models keys each in the index by its
        own; else the first one a prefill advertised."""
        if self._model:
            return self._model
        advertised = self.pool.served().prefill_models
        if named is not None and named in advertised:
            return named
        return advertised[0] if advertised else None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="gateway-monitor")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])  # a Redis registrar can lose one cancel
            self._task = None

    def wake(self) -> None:
        """A worker was added: check it now rather than at the next tick."""
        self._wake.set()

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self.run_once()
            except Exception:
                log.exception("a monitor round failed; the next one runs as planned")
            due = [*self._next_health.values(), *self._next_directory.values()]
            pause = max(0.0, min(due) - self._clock()) if due else self._config.interval_secs
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(pause):  # wait_for can lose a stop on 3.11
                    await self._wake.wait()

    async def run_once(self, *, force: bool = False) -> None:
        workers = list(self.pool)
        live = {w.id for w in workers}
        for table in (self._next_health, self._next_directory):
            for stale in set(table) - live:
                del table[stale]
        await self._check_registrations(force)
        await asyncio.gather(*(self._check(w, force) for w in workers))

    async def _check(self, worker: Worker, force: bool) -> None:
        now = self._clock()
        if force or now >= self._next_health.get(worker.id, 0.0):
            await self._check_health(worker)
            interval = (
                self._config.interval_secs
                if worker.health.state is Health.HEALTHY
                else self._config.startup_check_interval_secs
            )
            self._next_health[worker.id] = self._clock() + interval
            if worker.health.healthy:
                await self._read_adapters(worker)
        if worker.spec.kind == "auto" and worker.detected_kind is None and worker.health.healthy:
            await self._detect(worker)
        if not worker.discovered and worker.health.healthy:
            await self._discover(worker)
        if worker.discovered:
            await self._register(worker)
        if worker.role != "prefill":
            return
        if worker.directory.port is not None and (
            force or now >= self._next_directory.get(worker.id, 0.0)
        ):
            await self._read_directory(worker)
            self._next_directory[worker.id] = self._clock() + self._config.directory_refresh_secs

    async def _check_health(self, worker: Worker) -> None:
        if self._config.disabled:
            return
        before = worker.health.state
        try:
            response = await self._client.get(
                worker.url + self._config.endpoint, timeout=self._config.timeout_secs
            )
            ok, error = response.status_code == 200, f"HTTP {response.status_code}"
        except LocalResourceError as exc:  # the gateway's own shortage says nothing of it
            log.error("health check of %s %s not made: %s", worker.role, worker.id, exc)
            return
        except httpx.HTTPError as exc:
            ok, error = False, f"{type(exc).__name__}: {exc}"
        after = worker.health.record(ok, None if ok else error)
        if after is not before:
            circuit = worker.breaker.retry_in()
            held = "" if circuit is None else f"; its circuit is open for {circuit:.0f} s more"
            level = logging.WARNING if after is Health.UNHEALTHY else logging.INFO
            log.log(
                level,
                "worker %s (%s) is now %s (%s)%s",
                worker.id,
                worker.role,
                after.value,
                error,
                held,
            )

    async def _read_adapters(self, worker: Worker) -> None:
        """Kept as they were when the worker does not answer: a missed read must not make
        every adapter request a 404."""
        found = await read_adapters(self._client, worker.url, self._config.timeout_secs)
        if found is not None and found != worker.adapters:
            log.info("%s %s serves the LoRA adapters %s", worker.role, worker.id, sorted(found))
            worker.adapters = found
            self.pool.changed()

    async def _detect(self, worker: Worker) -> None:
        """Asked each round until the worker tells; undetected, it is treated as SGLang."""
        found = await detect_kind(self._client, worker.url, self._config.timeout_secs)
        if found.model and not worker.served_model:
            worker.served_model = found.model
            self.pool.changed()
        if found.kind is not None and found.kind != worker.detected_kind:
            worker.detected_kind = found.kind
            self.pool.changed()
            log.info("%s %s speaks %s (%s)", worker.role, worker.id, found.kind, found.how)

    async def _discover(self, worker: Worker) -> None:
        found = await read_advertised(self._client, worker, self._config.timeout_secs)
        if isinstance(found, Retry):
            self._discovery_failed(worker, f"{found.error}; asked again next round")
            return
        if found.silent is not None or found.sources.problem is not None:
            error = found.silent or found.sources.problem
            worker.note_error(f"{error}; nothing discovered", self._clock(), "discovery")
            log.warning("%s %s: %s; nothing discovered", worker.role, worker.id, error)
        else:
            worker.step_succeeded("discovery")
        worker.discovered = True
        if worker.kv_events is None:
            worker.kv_events = found.kv_events
            if found.sources.kv_events is not None and found.dp_size:
                worker.directory.dp_size = found.dp_size
        model = found.info.model
        if model and model != worker.served_model:
            worker.served_model = model
        worker.engine_block_size = found.block_size
        worker.kv_capacity_tokens = found.capacity_tokens
        self.pool.changed()  # its pod, capacity, model, maybe its directory's status
        if worker.role != "prefill":
            return
        if found.info.dp_size:
            worker.directory.dp_size = found.info.dp_size
        if worker.directory.port is None:
            worker.directory.port = found.info.bootstrap_port
        if worker.directory.port is None:
            worker.directory.status = DirectoryStatus.UNKNOWN
            self.pool.changed()
            log.warning(
                "prefill %s: no bootstrap port given or advertised; its directory readiness "
                "is unknown and it stays eligible",
                worker.id,
            )

    def _discovery_failed(self, worker: Worker, error: str) -> None:
        """Noted each time, logged when it is news (discovery is retried every round)."""
        if worker.last_error != error:
            log.warning("%s %s: %s", worker.role, worker.id, error)
        worker.note_error(error, self._clock(), "discovery")

    async def _register(self, worker: Worker) -> None:
        events = worker.kv_events
        if self._registrar is None or events is None:
            return
        if events.endpoint is None and not (events.mode == "bind" and events.topic):
            return
        if worker.registered_pod == worker.pod:
            return
        pod = PodRegistration(
            id=worker.pod,
            model=self.served_model(worker.served_model),
            block_size=worker.engine_block_size or self._block_size,
            role=worker.role,
            url=worker.url,
            bootstrap_host=worker.host,
            bootstrap_port=worker.directory.port,
            kv_events=events,
            dp_size=worker.directory.dp_size,
        )
        try:
            await self._registrar.register(pod)
        except RegistrationFailed as exc:  # retried next round, and shown
            worker.note_error(f"pod registration: {exc!r}", self._clock(), "registration")
            log.warning("%s %s: registering pod %s failed: %r", worker.role, worker.id, pod.id, exc)
            return
        worker.step_succeeded("registration")
        worker.registered_pod = pod.id
        log.info("%s %s registered with the index as pod %s", worker.role, worker.id, pod.id)

    async def _check_registrations(self, force: bool) -> None:
        """Forget the registration of each pod the index no longer lists, so that this
        round registers it again. An index that cannot be read changes nothing: its
        pods are checked again once it answers."""
        if self._registrar is None:
            return
        registered = [w for w in self.pool if w.registered_pod is not None]
        now = self._clock()
        if not registered or (not force and now < self._next_listing):
            return
        self._next_listing = now + self._config.registration_check_secs
        try:
            listed = await self._registrar.listed()
        except RegistrationFailed as exc:
            log.debug("the index's pods could not be listed: %s", exc)
            return
        for worker in registered:
            if worker.registered_pod not in listed:
                log.warning(
                    "%s %s: the index no longer lists its pod %s (an indexer restarted "
                    "without its pods?); registering it again",
                    worker.role,
                    worker.id,
                    worker.registered_pod,
                )
                worker.registered_pod = None

    async def unregister(self, worker: Worker) -> None:
        if self._registrar is not None and worker.registered_pod is not None:
            await self._registrar.unregister(worker.registered_pod)

    async def _read_directory(self, worker: Worker) -> None:
        directory = worker.directory
        if self._probe is None:
            if directory.status is not DirectoryStatus.UNKNOWN:
                directory.status = DirectoryStatus.UNKNOWN
                self.pool.changed()
            return
        host = f"[{worker.host}]" if ":" in worker.host else worker.host
        scheme = urlsplit(worker.url).scheme
        url = urlunsplit((scheme, f"{host}:{directory.port}", "", "", ""))
        before = directory.status
        reading = await self._probe.read(url)
        directory.registered, directory.expected = reading.registered, reading.expected
        directory.error = reading.error
        directory.misses = 0 if reading.reachable else directory.misses + 1
        if not reading.reachable:
            if before is not DirectoryStatus.READY or (
                directory.misses >= self._config.failure_threshold
            ):
                directory.status = DirectoryStatus.UNREACHABLE
        elif reading.ready:
            directory.status = DirectoryStatus.READY
            topology = reading.topology or {}
            dp_size = int_or_none(topology.get("dp_size"))
            if dp_size:
                directory.dp_size = dp_size
            directory.follow_bootstrap_room = bool(topology.get("follow_bootstrap_room"))
        else:
            directory.status = DirectoryStatus.NOT_READY
        if directory.status is not before:
            self.pool.changed()
            log.info(
                "prefill %s: bootstrap directory %s is %s (%s)",
                worker.id,
                url,
                directory.status.value,
                directory.error or f"{directory.registered}/{directory.expected} ranks",
            )
