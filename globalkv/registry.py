"""The pods the index follows, stored with the index so every gateway reads one view.

A pod is written by whoever knows it — the indexer's API, its `--pod` flags, a gateway
writing the shared Redis directly, or the indexer itself when an unknown engine shows up
on its bound socket — and followed by the indexer, which notices changes through a
notification (Redis pub/sub, or in-process for the memory registry) and a periodic
reconciliation, because pub/sub messages are lost while a subscriber reconnects.

Next to each pod the indexer writes its ingest state (subscribed, last seq, last event
time, resets, drops), so `globalkv pods` and `doctor` read freshness from any process.

In Redis (keys named in `index.redis_keys`, under the index's hash tag, so each write is
one script): the pods, their states (written only beside a listed pod, so a state
published just after its pod was removed does not outlive it), a marker (absent after a
Redis restart or flush, so the indexer can tell "everyone deleted their pods" from "Redis
lost them" and write back what it knows), and a change channel (a cluster forwards it to
every node).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Annotated, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from globalkv.index.redis_failures import any_failure_unavailable
from globalkv.index.redis_keys import RedisKeys
from globalkv.redis_client import Client, text
from kvplumbing.addresses import is_host, is_ipv6
from kvplumbing.endpoints import offset_endpoint
from kvplumbing.topics import parse_topic

log = logging.getLogger(__name__)

PodId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:\[\]\-]+$")]
"""Letters, digits and `._:-[]`: host names, `host:port` and `[IPv6]:port` (the gateway's
worker ids), nothing that would need escaping in a topic, a Redis key or a log line."""
MAX_DP_SIZE = 1024
"""DP ranks one pod may have: each is a publisher with its own worker and subscription,
so a batch naming a rank beyond this is refused rather than followed."""
_TCP_ENDPOINT = re.compile(r"tcp://(\[[^\]]+\]|[^\[\]]+):([0-9]{1,5})", re.ASCII)


def _tcp_host_ok(host: str) -> bool:
    """A host ZMQ can connect to (`kvplumbing.hosts`), IPv6 in brackets. ZMQ accepts some
    malformed names at connect and refuses others (`-`, `%`, `a@b`, non-ASCII) only then,
    so the rule is the strict one rather than ZMQ's."""
    if host.startswith("[") and host.endswith("]"):
        return is_ipv6(host[1:-1])
    return is_host(host)


class KvEventsConfig(BaseModel):
    """Where a pod publishes its KV events (the engine's `--kv-events-config`, as seen
    from the indexer)."""

    model_config = ConfigDict(extra="forbid")

    endpoint: str | None = Field(
        None,
        description="The engine's PUB endpoint the indexer connects to (tcp://host:port); "
        "with dp_size > 1 rank r publishes on port + r. Required in connect mode.",
    )
    replay_endpoint: str | None = Field(
        None, description="The engine's replay ROUTER (port + r per DP rank); none = no replay."
    )
    topic: str = Field("", max_length=512, description="ZMQ topic; llm-d uses kv@<pod>@<model>.")
    mode: Literal["connect", "bind"] = Field(
        "connect",
        description="connect: the indexer connects a SUB to `endpoint`. bind: the engine "
        "connects to the indexer's bound SUB (`--bind`) and is recognised by `topic`.",
    )

    @model_validator(mode="after")
    def _endpoints(self) -> KvEventsConfig:
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"kv_events.{name} {value!r} must be a tcp://, ipc:// URL")
            if value is not None and "*" in value:
                raise ValueError(f"kv_events.{name} {value!r} is a bind address, not connectable")
            if value is not None and value.startswith("tcp://"):
                # ZMQ refuses a malformed address only when the SUB connects, long after
                # the pod was accepted: checked here, it is a 422 instead.
                match = _TCP_ENDPOINT.fullmatch(value)
                if match is None or not _tcp_host_ok(match[1]) or not 0 < int(match[2]) < 65536:
                    raise ValueError(
                        f"kv_events.{name} {value!r} must be tcp://host:port: host a DNS name "
                        "(letters, digits, inner '-', dot-separated), an IPv4 address or a "
                        "[bracketed] IPv6 address; port 1-65535"
                    )
        if self.mode == "connect" and self.endpoint is None:
            raise ValueError("kv_events.endpoint is required unless mode is 'bind'")
        if self.mode == "bind" and not self.topic:
            raise ValueError("kv_events.topic is required in bind mode (it names the pod)")
        return self


class PodInfo(BaseModel):
    """One engine instance as the index and the gateways know it."""

    model_config = ConfigDict(extra="forbid")

    id: PodId
    model: str = Field(
        "",
        max_length=512,
        description="Served model name; part of every block key's namespace. Defaults to "
        "the <model> of a kv@<pod>@<model> topic.",
    )
    block_size: int | None = Field(None, gt=0, le=1 << 20, description="Engine page size.")
    role: Literal["prefill", "decode", "mixed"] = "prefill"
    url: str | None = Field(None, max_length=2048, description="The engine's HTTP URL.")
    bootstrap_host: str | None = Field(None, max_length=255)
    bootstrap_port: int | None = Field(None, ge=1, le=65535)
    kv_events: KvEventsConfig
    dp_size: int = Field(1, ge=1, le=MAX_DP_SIZE, description="DP ranks, each its own publisher.")

    @model_validator(mode="after")
    def _model_from_topic(self) -> PodInfo:
        if self.kv_events.mode == "connect":
            for endpoint in (self.kv_events.endpoint, self.kv_events.replay_endpoint):
                if endpoint is not None:
                    try:
                        offset_endpoint(endpoint, self.dp_size - 1)
                    except ValueError as exc:
                        raise ValueError(f"dp_size {self.dp_size}: {exc}") from None
        if not self.model:
            parsed = parse_topic(self.kv_events.topic)
            if parsed is not None:
                self.model = parsed[1]
        return self


class SourceProgress(BaseModel):
    """How far the indexer has got with one DP rank's events (`PodState.sources`)."""

    dp_rank: int
    received: int = 0
    """Live batches of this source that reached the indexer (replayed ones are not)."""
    last_seq: int | None = None
    last_event_ts: float | None = None
    """The engine's timestamp of the last applied batch."""
    last_applied_at: float | None = None
    """Indexer wall time when it was applied."""
    applied: int = 0
    resets: int = 0
    drops: int = 0
    queue_depth: int = 0


class PodState(BaseModel):
    subscribed: bool = False
    """The indexer listens where this pod's events arrive: a SUB connected to each DP rank's
    PUB (connect mode), or its own bound SUB (bind mode; false when it binds none). ZMQ
    connects silently in both directions, so this does not say that the engine is there."""
    receiving: bool = False
    """An event of this pod reached the indexer since it began following it: the only proof
    that the engine's PUB and our SUB found each other. An idle engine publishes nothing,
    so false alone is no fault; in bind mode the pod has no sources until it is true."""
    resyncing: bool = False
    sources: list[SourceProgress] = Field(default_factory=list)
    updated_at: float | None = None


class Registry(Protocol):
    async def put(self, pod: PodInfo) -> None: ...

    async def remove(self, pod_id: str) -> bool:
        """True if the pod existed."""
        ...

    async def get(self, pod_id: str) -> PodInfo | None: ...

    async def list(self) -> list[PodInfo]: ...

    async def put_states(self, states: dict[str, PodState]) -> None: ...

    async def states(self) -> dict[str, PodState]: ...

    async def intact(self) -> bool:
        """False when the store lost what was written (Redis restarted empty)."""
        ...

    async def mark(self) -> None:
        """Record that the store holds our writes; `intact` is False again once it is lost."""
        ...

    def changes(self) -> AsyncGenerator[str, None]:
        """Pod ids as others change them; runs until cancelled. May miss some: reconcile."""
        ...

    async def close(self) -> None: ...


class MemoryRegistry:
    """The embedded default: this process is the only reader and writer."""

    def __init__(self) -> None:
        self._pods: dict[str, PodInfo] = {}
        self._states: dict[str, PodState] = {}
        self._listeners: set[asyncio.Queue[str]] = set()

    async def put(self, pod: PodInfo) -> None:
        self._pods[pod.id] = pod
        self._notify(pod.id)

    async def remove(self, pod_id: str) -> bool:
        self._states.pop(pod_id, None)
        existed = self._pods.pop(pod_id, None) is not None
        if existed:
            self._notify(pod_id)
        return existed

    async def get(self, pod_id: str) -> PodInfo | None:
        return self._pods.get(pod_id)

    async def list(self) -> list[PodInfo]:
        return sorted(self._pods.values(), key=lambda p: p.id)

    async def put_states(self, states: dict[str, PodState]) -> None:
        self._states.update({k: v for k, v in states.items() if k in self._pods})

    async def states(self) -> dict[str, PodState]:
        return dict(self._states)

    async def intact(self) -> bool:
        return True

    async def mark(self) -> None:
        return None

    def _notify(self, pod_id: str) -> None:
        for queue in self._listeners:
            queue.put_nowait(pod_id)

    async def changes(self) -> AsyncGenerator[str, None]:
        queue: asyncio.Queue[str] = asyncio.Queue()
        self._listeners.add(queue)
        try:
            while True:
                yield await queue.get()
        finally:
            self._listeners.discard(queue)

    async def close(self) -> None:
        return None


# Each write and its change notice in one script: one round trip, atomic, and on a
# cluster (where a pipeline may not PUBLISH) on the master of the registry's slot.
_PUT = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('SET', KEYS[2], '1')
redis.call('PUBLISH', ARGV[3], ARGV[1])
"""
_REMOVE = """
local removed = redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('PUBLISH', ARGV[2], ARGV[1])
return removed
"""
_PUT_STATES = """
for i = 1, #ARGV, 2 do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 1 then
    redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
  end
end
"""


class RedisRegistry:
    """Pods in the index's Redis, readable and writable by every gateway."""

    def __init__(self, redis: Client, *, prefix: str = "gkv") -> None:
        self.redis = redis
        self._put = redis.register_script(_PUT)
        self._remove = redis.register_script(_REMOVE)
        self._put_states = redis.register_script(_PUT_STATES)
        keys = RedisKeys(prefix)
        self.pods_key = keys.registry_pods
        self.state_key = keys.registry_state
        self.marker_key = keys.registry_marker
        self.channel = keys.registry_changed

    async def put(self, pod: PodInfo) -> None:
        keys = [self.pods_key, self.marker_key]
        async with self._errors():
            await self._put(keys=keys, args=[pod.id, pod.model_dump_json(), self.channel])

    async def remove(self, pod_id: str) -> bool:
        async with self._errors():
            removed = await self._remove(
                keys=[self.pods_key, self.state_key], args=[pod_id, self.channel]
            )
        return bool(removed)

    async def get(self, pod_id: str) -> PodInfo | None:
        async with self._errors():
            raw = await self.redis.hget(self.pods_key, pod_id)
        return None if raw is None else _parse_pod(raw)

    async def list(self) -> list[PodInfo]:
        async with self._errors():
            raw = await self.redis.hgetall(self.pods_key)
        pods = (_parse_pod(v) for v in raw.values())
        return sorted((p for p in pods if p is not None), key=lambda p: p.id)

    async def put_states(self, states: dict[str, PodState]) -> None:
        if not states:
            return
        pairs = [x for pod_id, state in states.items() for x in (pod_id, state.model_dump_json())]
        async with self._errors():
            await self._put_states(keys=[self.pods_key, self.state_key], args=pairs)

    async def states(self) -> dict[str, PodState]:
        async with self._errors():
            raw = await self.redis.hgetall(self.state_key)
        out: dict[str, PodState] = {}
        for key, value in raw.items():
            with contextlib.suppress(ValidationError):
                out[text(key)] = PodState.model_validate_json(value)
        return out

    async def intact(self) -> bool:
        async with self._errors():
            return bool(await self.redis.exists(self.marker_key))

    async def mark(self) -> None:
        async with self._errors():
            await self.redis.set(self.marker_key, "1")

    async def changes(self) -> AsyncGenerator[str, None]:
        pubsub = self.redis.pubsub()
        try:
            async with self._errors():
                if isinstance(self.redis, RedisCluster):
                    await self.redis.initialize()  # its pub/sub needs the slot map
                await pubsub.subscribe(self.channel)
            while True:
                # Blocking read (timeout=None): redis-py can swallow a cancellation that
                # lands while its own read timeout fires, which would leave us looping.
                async with self._errors():
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=None)
                if message is not None and message.get("type") == "message":
                    yield text(message["data"])
        finally:
            with contextlib.suppress(RedisError, OSError):
                await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # typed from 8.2

    async def close(self) -> None:
        return None

    @contextlib.asynccontextmanager
    async def _errors(self) -> AsyncIterator[None]:
        with any_failure_unavailable("pod registry unreachable"):
            yield


def _parse_pod(raw: bytes | str) -> PodInfo | None:
    """A pod written by another process; an unreadable entry is logged and skipped."""
    try:
        return PodInfo.model_validate_json(raw)
    except ValidationError as exc:
        log.warning("skipping an unreadable pod in the registry: %s", exc)
        return None
