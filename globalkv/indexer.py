"""`globalkv indexer` assembled: index backend, pod registry, ingest, pod sync and the API.

The pieces take their collaborators as arguments (tests build them around a fake index
or a throw-away Redis); `build_indexer` picks the real ones from the configuration: the
in-memory index and registry by default, or both in Redis with `redis_url`, where every
gateway can read them. With `replicas`, several indexers on that Redis share the pods by
leases (`ingest.ownership`), each following the pods it holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
from collections.abc import AsyncIterator

import zmq.asyncio
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, Field, field_validator, model_validator

from globalkv import redis_client
from globalkv.api import ApiConfig, create_app
from globalkv.index.base import Index, IndexUnavailable
from globalkv.index.instrumented import InstrumentedIndex
from globalkv.index.memory import MemoryIndex
from globalkv.index.redis import RedisIndex
from globalkv.ingest.config import IngestConfig
from globalkv.ingest.followed import TopicTaken
from globalkv.ingest.leases import Leases
from globalkv.ingest.ownership import HeldLeases, Ownership
from globalkv.ingest.podsync import PodSync
from globalkv.ingest.service import IngestService
from globalkv.metrics import IngestMetrics
from globalkv.registry import MemoryRegistry, PodInfo, RedisRegistry, Registry
from globalkv.tokenize import Tokenizer, load_tokenizer
from kvplumbing.tasks import cancel_and_wait

log = logging.getLogger(__name__)


class IndexerConfig(BaseModel):
    host: str = Field("0.0.0.0", description="HTTP listen address.")
    port: int = Field(8100, ge=0, le=65535, description="HTTP port.")
    redis_url: str | None = Field(
        None, description="Keep the index and pod registry in this Redis; memory if unset."
    )
    redis_prefix: str = Field("gkv", min_length=1, description="Prefix of every Redis key.")
    block_size: int = Field(16, ge=1, le=1 << 16, description="Tokens per index block.")
    max_entries: int | None = Field(
        None, ge=1, description="Memory index bound in (block, source) entries."
    )
    tokenizer: str | None = Field(
        None, description="tokenizer.json (or its directory) or 'byte', for text lookups."
    )
    pods: list[PodInfo] = Field(default_factory=list, description="Pods to follow at start.")
    reconcile_interval: float = Field(
        5.0, gt=0, description="Seconds between pod-registry reconciliations."
    )
    replicas: bool = Field(
        False,
        description="Share the pods with the other indexers on this Redis: each pod is "
        "followed by the one holding its lease (needs redis_url).",
    )
    lease_ttl: float = Field(
        4.0,
        ge=0.3,
        le=300,
        description="Seconds a pod's lease lasts unrenewed: about the longest a pod goes "
        "unfollowed when its indexer dies (4 s: a takeover within 5 s, with the time the "
        "survivor takes to subscribe). Renewed every third of it.",
    )
    indexer_id: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9._\-]+$",
        description="This indexer's name among replicas; host name and pid if unset. "
        "Letters, digits, '.', '_' and '-'.",
    )
    api: ApiConfig = Field(default_factory=ApiConfig)
    ingest: IngestConfig = Field(default_factory=IngestConfig)

    @property
    def member_id(self) -> str:
        return self.indexer_id or f"{socket.gethostname()}-{os.getpid()}"

    @field_validator("indexer_id", mode="before")
    @classmethod
    def _no_separator(cls, value: object) -> object:
        """A fencing token is "<counter>:<id>/<process>": an id with ':' or '/' could be
        read as another token's parts (a barrier "<n>:" is a token with no holder)."""
        if isinstance(value, str) and (":" in value or "/" in value):
            raise ValueError(f"indexer_id {value!r} may not hold ':' or '/' (fencing tokens)")
        return value

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str | None) -> str | None:
        return None if value is None else redis_client.check_url(value)

    @model_validator(mode="after")
    def _replicas_share_redis(self) -> IndexerConfig:
        if self.replicas and self.redis_url is None:
            raise ValueError("replicas share pods through Redis: give redis_url too")
        return self

    @model_validator(mode="after")
    def _keyable_pods(self) -> IndexerConfig:
        ids: set[str] = set()
        topics: dict[str, str] = {}
        for pod in self.pods:
            if pod.block_size is not None and pod.block_size % self.block_size:
                raise ValueError(
                    f"pod {pod.id}: block_size {pod.block_size} is not a multiple of the "
                    f"index block size {self.block_size}"
                )
            if pod.id in ids:
                raise ValueError(f"pod {pod.id} is given twice")
            self.ingest.check_endpoints(pod)
            ids.add(pod.id)
            if pod.kv_events.mode == "bind":
                holder = topics.setdefault(pod.kv_events.topic, pod.id)
                if holder != pod.id:
                    raise ValueError(
                        f"pods {holder} and {pod.id} both name the topic {pod.kv_events.topic!r}"
                    )
        return self


class Indexer:
    """Everything one indexer process runs, started and stopped by the app's lifespan."""

    def __init__(
        self,
        config: IndexerConfig,
        *,
        index: Index,
        registry: Registry,
        metrics_registry: CollectorRegistry | None = None,
        tokenizer: Tokenizer | None = None,
        context: zmq.asyncio.Context | None = None,
        redis: redis_client.Client | None = None,
        leases: Leases | None = None,
    ) -> None:
        """`redis`, when given, is the client behind index and registry; it is closed on
        stop (backends never close a client they were handed). `leases`: share the pods
        with other indexers (`index` must then be a fenced `RedisIndex`)."""
        self.config = config
        self.redis = redis
        self.registry = registry
        self.metrics_registry = metrics_registry or CollectorRegistry()
        self.index: Index = InstrumentedIndex(index, self.metrics_registry)
        metrics = IngestMetrics(self.metrics_registry)
        shared: tuple[Leases, RedisIndex, HeldLeases] | None = None
        if leases is not None:
            if not (isinstance(index, RedisIndex) and index.fenced):
                raise ValueError("indexer replicas need a fenced RedisIndex")
            shared = (leases, index, HeldLeases(metrics, set_fence=index.set_fence))
        self.ingest = IngestService(
            self.index,
            registry,
            metrics,
            config.ingest,
            gate=None if shared is None else shared[2],
            context=context,
        )
        self.ownership: Ownership | None = None
        if shared is not None:
            leases, fenced, held = shared
            self.ownership = Ownership(
                leases,
                registry,
                self.ingest.following,
                held,
                metrics,
                member=config.member_id,
                ttl=config.lease_ttl,
                copy_fence=fenced.copy_fence,
            )
        self.podsync = PodSync(registry, self.ingest, interval=config.reconcile_interval)
        self._podsync_task: asyncio.Task[None] | None = None
        self._ownership_task: asyncio.Task[None] | None = None
        self.app: FastAPI = create_app(
            config.api,
            index=self.index,
            registry=registry,
            ingest=self.ingest,
            metrics_registry=self.metrics_registry,
            tokenizer=tokenizer,
            lifespan=self._lifespan,
            member=config.member_id,
            leases=leases,
        )

    async def start(self) -> None:
        for warning in self.config.api.protected_mode().warnings():
            log.warning("%s", warning)
        await self.ingest.start()
        for pod in self.config.pods:
            try:
                await self.registry.put(pod)
            except IndexUnavailable as exc:
                log.warning("could not write pod %s to the registry yet: %s", pod.id, exc)
            try:
                await self.ingest.following.add(pod)
            except TopicTaken as exc:  # a pod appeared on the bound socket first
                log.error("not following pod %s: %s", pod.id, exc)
        with contextlib.suppress(IndexUnavailable):
            await self.registry.mark()
        if self.ownership is not None:
            try:
                await self.ownership.step()
            except IndexUnavailable as exc:
                log.warning("leases: redis unavailable: %s", exc)
            self._ownership_task = asyncio.create_task(self.ownership.run(), name="ownership")
        self._podsync_task = asyncio.create_task(self.podsync.run(), name="podsync")
        log.info(
            "indexer on %s:%d, %s index, block size %d, %d pods",
            self.config.host,
            self.config.port,
            "redis" if self.config.redis_url else "memory",
            self.config.block_size,
            len(self.ingest.following.pods()),
        )

    async def stop(self) -> None:
        tasks = [t for t in (self._podsync_task, self._ownership_task) if t is not None]
        await cancel_and_wait(tasks)
        if self.ownership is not None:
            try:
                await self.ownership.stop()
            except IndexUnavailable as exc:
                log.warning("leases not released (they expire by themselves): %s", exc)
        await self.ingest.stop()
        await self.registry.close()
        await self.index.close()
        if self.redis is not None:
            await self.redis.aclose()

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        await self.start()
        # The ~74k objects of imports and setup never die; frozen, full collections stop
        # walking them (16 ms each under load, measured by bench.freshness). The index's
        # own blocks are plain ints the collector does not track.
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            await self.stop()


def build_indexer(config: IndexerConfig) -> Indexer:
    tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer else None
    if config.redis_url is None:
        return Indexer(
            config,
            index=MemoryIndex(config.block_size, max_entries=config.max_entries),
            registry=MemoryRegistry(),
            tokenizer=tokenizer,
        )
    redis = redis_client.connect(config.redis_url)
    prefix = config.redis_prefix
    return Indexer(
        config,
        index=RedisIndex(redis, config.block_size, prefix=prefix, fenced=config.replicas),
        registry=RedisRegistry(redis, prefix=prefix),
        tokenizer=tokenizer,
        redis=redis,
        leases=Leases(redis, prefix=prefix) if config.replicas else None,
    )


def run_indexer(config: IndexerConfig) -> int:
    """Serve until SIGTERM/SIGINT, then shut down cleanly and return 0 (1 if it never
    started, e.g. the port was taken)."""
    import uvicorn
    import uvloop

    indexer = build_indexer(config)
    server = uvicorn.Server(
        uvicorn.Config(
            indexer.app,
            host=config.host,
            port=config.port,
            loop="none",
            http="httptools",
            log_level="warning",
        )
    )
    # uvicorn re-raises the stopping signal once shut down, to the handler it found:
    # ours, so that a requested stop is an ordinary exit.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: log.info("stopped by signal %d", signum))
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(server.serve())
    return 0 if server.started else 1
