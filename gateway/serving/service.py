"""One gateway's parts wired together: pool, load, policies, router, legs, dispatcher, monitor.

Built from the configuration and the collaborators the caller owns (the pooled httpx
client, the upstream the legs call workers through — by default that same client —, the
index lookup, the pod registrar, the directory reader, the tokenizer, the clock), so tests
swap any of them; `inference` and `app` serve it, `gateway.serving.launch` builds it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from random import Random
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
from prometheus_client import CollectorRegistry

from gateway.flow.control import FlowControl
from gateway.flow.headroom import Headroom
from gateway.http.server import default_max_connections
from gateway.http.upstream import HttpxUpstream, Upstream
from gateway.legs.attempt import Legs
from gateway.legs.calls import PairCalls
from gateway.legs.dispatch import Chooser, Dispatcher
from gateway.legs.local import LocalLegs
from gateway.legs.retry import RetrySchedule
from gateway.legs.sglang import DualLegs
from gateway.legs.traced import TracedCalls, TracedDispatcher
from gateway.legs.vllm import SequentialLegs
from gateway.load.pending import PendingPrefixes
from gateway.load.tracker import LoadTracker
from gateway.policies import build_policy
from gateway.routing.decider import PdDecider
from gateway.routing.pd_chooser import PdChooser
from gateway.routing.router import Router
from gateway.settings.base import Kind
from gateway.settings.config import GatewayConfig
from gateway.settings.workers import WorkerSpec
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.tracing import Tracing
from gateway.workers.monitor import DirectoryProbe, Monitor, PodRegistrar
from gateway.workers.pool import Worker, WorkerPool
from globalkv.lookup import PrefixLookup
from globalkv.tokenize import Tokenizer
from kvplumbing.addresses import redacted
from kvplumbing.budget import BodyBudget
from kvplumbing.clock import Clock, Sleep

log = logging.getLogger(__name__)

_NOT_SHOWN = {"prefill", "decode", "api_key", "admin_token", "indexer_token", "redis_url"}
"""Left out of `effective_config`: the workers (`/workers` lists them) and secrets."""


@dataclass(slots=True)
class Gateway:
    config: GatewayConfig
    client: httpx.AsyncClient
    pool: WorkerPool
    loads: LoadTracker
    router: Router
    calls: PairCalls
    dispatcher: Dispatcher
    monitor: Monitor
    metrics: GatewayMetrics
    tokenizer: Tokenizer | None
    clock: Clock
    bodies: BodyBudget
    """The request-body bytes the process holds at once (`--max-buffered-payload-size`)."""
    tracing: Tracing | None = None
    """Spans of each request when traces are exported (`gateway.telemetry.tracing`)."""
    flow: FlowControl | None = None
    """Per-tenant queues in priority bands, with `--flow-control` (`gateway.flow`)."""

    def add_worker(self, spec: WorkerSpec) -> Worker:
        worker = self.pool.add(spec)
        self.monitor.wake()
        log.info("added %s worker %s", spec.role, worker.id)
        return worker

    async def remove_worker(self, worker_id: str) -> Worker | None:
        worker = self.pool.remove(worker_id)
        if worker is None:
            return None
        self.router.forget(worker.id)
        log.info("removed %s worker %s", worker.role, worker.id)
        await self.monitor.unregister(worker)
        return worker

    def find(self, key: str) -> Worker | None:
        """A worker by id (`host:port`) or by URL."""
        found = self.pool.get(key)
        if found is not None:
            return found
        return next((w for w in self.pool if w.url == key.rstrip("/")), None)

    def effective_config(self) -> dict[str, Any]:
        """The settings in force, for `GET /v1/config` and `globalkv doctor`: what routing
        uses (policies and weights, the index, the model and tokenizer), which would
        otherwise have to be guessed from the metrics. A setting left to a default derived
        at start-up shows the value derived (the body budget, the client connections, where
        spans go). Secrets are only said to be set; URLs are shown without credentials."""
        config = self.config
        shown = config.model_dump(mode="json", exclude=_NOT_SHOWN)
        index = "indexer" if config.indexer_url else "redis" if config.redis_url else None
        traces = config.traces_endpoint
        shown.update(
            max_buffered_payload_size=config.body_budget,
            max_client_connections=config.max_client_connections or default_max_connections(),
            otlp_traces_endpoint=None if traces is None else redacted(traces),
            index=index,
            redis_url=_without_credentials(config.redis_url),
            model_in_use=self.monitor.served_model(),
            tokenizer_loaded=self.tokenizer is not None,
            api_key_set=config.api_key is not None,
            admin_token_set=config.admin_token is not None,
            indexer_token_set=config.indexer_token is not None,
        )
        return shown

    async def close(self, drain_secs: float = 2.0) -> None:
        """Stop the monitor; prefill calls still running after `drain_secs` are cancelled
        (their requests were answered: a hung prefill must not hold the shutdown)."""
        await self.monitor.stop()
        await self.calls.drain(drain_secs)


def _without_credentials(url: str | None) -> str | None:
    if url is None:
        return None
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def build_gateway(
    config: GatewayConfig,
    client: httpx.AsyncClient,
    *,
    upstream: Upstream | None = None,
    lookup: PrefixLookup | None = None,
    registrar: PodRegistrar | None = None,
    probe: DirectoryProbe | None = None,
    tokenizer: Tokenizer | None = None,
    registry: CollectorRegistry | None = None,
    clock: Clock = time.monotonic,
    sleep: Sleep = asyncio.sleep,
    rng: Random | None = None,
    room_rng: Random | None = None,
    chooser: Callable[[Router], Chooser] | None = None,
    tracing: Tracing | None = None,
) -> Gateway:
    """`chooser`: what chooses each attempt's pair, built on the router (default: the
    router itself; a decode's sidecar fixes the decode). `tracing`: spans of each request,
    its stages and calls, when traces are exported."""
    rng = rng or Random(config.seed)
    metrics = GatewayMetrics(registry or CollectorRegistry())
    pool = WorkerPool(config.breaker, config.health, clock)
    grace = config.prefix.pending_grace_secs
    loads = LoadTracker(pending=None if grace is None else PendingPrefixes(grace), clock=clock)
    metrics.watch_pool(pool, loads)
    bodies = BodyBudget(config.body_budget)
    metrics.watch_bodies(bodies)
    monitor = Monitor(
        pool,
        client,
        config.health,
        probe,
        registrar,
        clock,
        model=config.model,
        block_size=config.block_size,
        sleep=sleep,
    )
    router = Router(
        pool,
        loads,
        build_policy(
            config.prefill_policy, rng, prefix=config.prefix, cache_aware=config.cache_aware
        ),
        build_policy(
            config.decode_policy, rng, prefix=config.prefix, cache_aware=config.cache_aware
        ),
        metrics,
        clock,
        lookup=lookup,
        model=monitor.served_model,
        lookup_timeout=config.lookup_timeout_secs,
        room_rng=room_rng,
        dp_aware=config.edge.dp_aware,
    )
    calls = (PairCalls if tracing is None else TracedCalls)(
        upstream or HttpxUpstream(client),
        loads,
        metrics,
        timeout=config.request_timeout_secs,
        clock=clock,
    )
    legs: dict[Kind, Legs] = {
        "sglang": DualLegs(calls),
        "vllm": SequentialLegs(calls, metrics, allow_recompute=config.vllm_allow_recompute),
    }
    dispatcher = (Dispatcher if tracing is None else TracedDispatcher)(
        PdChooser(router, PdDecider(config.pd_decider), metrics.pd_decisions)
        if chooser is None
        else chooser(router),
        legs,
        RetrySchedule(config.retry, rng),
        metrics,
        timeout=config.request_timeout_secs,
        sleep=sleep,
        local=LocalLegs(calls),
    )
    gateway = Gateway(
        config,
        client,
        pool,
        loads,
        router,
        calls,
        dispatcher,
        monitor,
        metrics,
        tokenizer,
        clock,
        bodies,
        tracing,
    )
    if config.flow.enabled:
        headroom = Headroom(router, config.pd_decider.transfer_tokens_per_s)
        gateway.flow = FlowControl(config.admission, config.flow, headroom, clock, metrics.registry)
    for spec in (*config.prefill, *config.decode):
        pool.add(spec)
    return gateway
