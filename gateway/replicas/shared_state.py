"""What gateway replicas share through Redis besides the index: their loads and the prompts
they sent but the index may not show yet.

Every `interval` a gateway publishes, per worker, its own requests in flight, queued
prefill tokens and remaining-work estimate (a hash with a TTL of three intervals), reads
the other live replicas' hashes, and sends the changes to its pending table since the last
round (prompts sent, prompts answered) on a pub/sub channel. Its policies then see its own
load plus the others' (`LoadTracker.shared`), at most about two intervals old, and the
others' pending prompts about one interval after they were sent.

Losing Redis falls back to the gateway's own view: the others' loads and pending prompts
are forgotten (not kept growing stale), `globalkv_gateway_shared_state_available` says 0
and each failed round is counted; the next round that succeeds shares again. Pending
messages lost while the subscription reconnects are forgotten the same way. A replica that
leaves the member list (its heartbeat ran out: it died) takes its pending prompts with it
(`gateway.replicas.shared_pending`); what is read of the others is checked first
(`gateway.replicas.shared_wire`).

Keys (`{p}` the prefix): `{p}:gateways` (sorted set: replica -> expiry, Redis time in ms),
`{p}:gw:{<replica>}:load` (hash: worker -> "in_flight,queued,remaining"), channel
`{p}:gw:pending`, and with `--flow-control` `{p}:gw:{<replica>}:flow` (its tenants' usage,
bands waiting and objectives active: `gateway.replicas.shared_flow`), rewritten and read
with the load tables. The same works on a Redis Cluster: each command names one key, the load
tables are read by a pipeline the cluster client splits per master, and a cluster forwards
a PUBLISH to every node, so a subscriber on any one of them hears every replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from gateway.flow.control import FlowControl
from gateway.load.pending import PendingHit
from gateway.load.tracker import LoadTracker
from gateway.replicas import shared_flow
from gateway.replicas.shared_pending import RemotePending
from gateway.replicas.shared_wire import (
    MAX_KEYS_PER_ADD,
    MAX_UNSENT_CHANGES,
    MAX_UNSENT_KEYS,
    batches,
    encode,
    keys_in,
    parse_change,
    parse_message,
    sum_loads,
    text,
)
from globalkv.index.redis_failures import CONNECTION_FAILURES, redis_failed
from globalkv.index.redis_keys import RedisKeys
from globalkv.redis_client import Client
from kvplumbing.tasks import cancel_and_wait

log = logging.getLogger(__name__)

_HEARTBEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf')
"""


def member_name(port: int) -> str:
    """This replica's name among the others: host, process and port say which it is, a
    random part that it is a new start. A restarted container keeps its host name and, as
    PID 1, its process id; under the same name its serials, counted from 0 again, would be
    taken for the ones its predecessor left pending at the others."""
    return f"{socket.gethostname()}-{os.getpid()}-{port}-{secrets.token_hex(3)}"


class SharedState:
    """A `LoadTracker.shared` view over Redis; `run()` publishes and reads until cancelled."""

    def __init__(
        self,
        redis: Client,
        tracker: LoadTracker,
        *,
        member: str,
        interval: float,
        registry: CollectorRegistry,
        prefix: str = "gkv",
        grace_s: float = 2.0,
    ) -> None:
        self.redis = redis
        self.tracker = tracker
        self.member = member
        self.interval = interval
        self.grace_s = grace_s
        self._keys = RedisKeys(prefix)
        self.members_key = self._keys.gateways
        self.channel = self._keys.gateway_pending
        self._heartbeat = redis.register_script(_HEARTBEAT)
        self._loads: dict[str, tuple[int, int, int]] = {}
        self._remote = RemotePending(grace_s)
        self._outbox: list[list[Any]] = []
        self._failing: dict[str, str] = {}
        self._logged: set[str] = set()
        self.flow: FlowControl | None = None
        """Flow control's state shared too, with `--flow-control` (`shared_flow`)."""
        self.listening = asyncio.Event()
        """Set while subscribed to the others' pending prompts (what is published before
        is not heard)."""
        self.available = Gauge(
            "globalkv_gateway_shared_state_available",
            "1 while this gateway shares loads and pending prompts with the other replicas "
            "through Redis; 0: it routes on its own view only.",
            registry=registry,
        )
        self.failures = Counter(
            "globalkv_gateway_shared_state_failures",
            "Rounds of sharing (publish, read, subscribe) that Redis failed.",
            registry=registry,
        )
        self.malformed = Counter(
            "globalkv_gateway_shared_state_malformed",
            "Values read from the other replicas (load entries, pending messages and changes) "
            "skipped as malformed.",
            ["what"],
            registry=registry,
        )
        self.replicas = Gauge(
            "globalkv_gateway_shared_replicas",
            "Other gateway replicas whose loads this one last read.",
            registry=registry,
        )

    def load_key(self, member: str) -> str:
        return self._keys.gateway_load(member)

    def flow_key(self, member: str) -> str:
        return self._keys.gateway_flow(member)

    # ------------------------------------------------------------ LoadTracker.shared

    def load(self, worker: str) -> tuple[int, int, int]:
        return self._loads.get(worker, (0, 0, 0))

    def pending(self, keys: Sequence[int], now: float) -> Mapping[str, PendingHit]:
        return self._remote.depths(keys, now)

    def sent(self, serial: int, worker: str, keys: Sequence[int], dp_rank: int | None) -> None:
        self._outbox.append(["add", serial, worker, list(keys[:MAX_KEYS_PER_ADD]), dp_rank])

    def answered(self, serial: int, computed: bool) -> None:
        self._outbox.append(["done", serial, computed])

    # ------------------------------------------------------------ the rounds

    async def run(self) -> None:
        listener = asyncio.create_task(self._listen(), name="shared state pending")
        try:
            while True:
                try:
                    await self.step()
                except CONNECTION_FAILURES as exc:
                    if not redis_failed(exc):
                        self._unexpected("a sharing round", exc)
                    self._fall_back(f"sharing round failed: {exc!r}")
                except Exception as exc:  # a bug must not stop sharing and freeze the loads
                    self._unexpected("a sharing round", exc)
                    self._fall_back(f"sharing round failed: {exc!r}")
                else:
                    self._failing.pop("a sharing round", None)
                await asyncio.sleep(self.interval)
        finally:
            await cancel_and_wait([listener])

    async def step(self) -> None:
        """Publish our loads and pending changes, read the others' loads, forget the pending
        prompts of the replicas that left."""
        now = self.tracker.clock()
        own = {
            worker: f"{load.in_flight},{load.progress.open_tokens},{load.progress.remaining(now)}"
            for worker, load in self.tracker.loads.items()
        }
        ttl = max(1, round(self.interval * 3000))
        outbox, self._outbox = self._outbox, []
        flow = self.flow
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.delete(self.load_key(self.member))
                if own:
                    items = [x for kv in own.items() for x in kv]
                    pipe.hset(self.load_key(self.member), items=items)
                pipe.pexpire(self.load_key(self.member), ttl)
                if flow is not None:
                    flow_key = self.flow_key(self.member)
                    pipe.delete(flow_key)
                    mine = shared_flow.fields(flow, now)
                    if mine:
                        pipe.hset(flow_key, items=[x for kv in mine.items() for x in kv])
                    pipe.pexpire(flow_key, ttl)
                await pipe.execute()
            asked = self.tracker.clock()
            listed = await self._heartbeat(keys=[self.members_key], args=[self.member, ttl])
        except BaseException:
            self._keep_unsent(outbox)
            raise
        members = {m for m in map(text, listed) if m is not None}
        # after the heartbeat: whoever hears this replica's changes finds it a member
        unsent = batches(outbox)
        try:
            while unsent:  # apart: a cluster pipeline may not PUBLISH
                await self.redis.publish(self.channel, encode(self.member, unsent[0]))
                del unsent[0]
        finally:
            self._keep_unsent([change for batch in unsent for change in batch])
        gone = self._remote.prune(members, asked)
        if gone:
            log.info("forgot the pending prompts of %d gateway replicas that left", gone)
        others = sorted(members - {self.member})
        async with self.redis.pipeline(transaction=False) as pipe:
            for member in others:
                pipe.hgetall(self.load_key(member))
                if flow is not None:
                    pipe.hgetall(self.flow_key(member))
            tables = await pipe.execute() if others else []
        step = 1 if flow is None else 2
        loads, skipped = sum_loads(tables[::step])
        if skipped:
            self._malformed("load entries", skipped)
        self._loads = loads
        if flow is not None:
            skipped = shared_flow.absorb(flow, tables[1::2], self.tracker.clock())
            if skipped:
                self._malformed("flow fields", skipped)
        self.replicas.set(len(others))
        self.available.set(1)

    def _keep_unsent(self, unsent: list[list[Any]]) -> None:
        """Put back, ahead of what came since, the changes a failed round did not send: a
        lost "done" would leave the prompt pending at the others for as long as this
        replica lives. A PUBLISH that failed may still have been delivered; sent again, an
        add replaces itself and a done finds nothing."""
        if not unsent:
            return
        kept = unsent + self._outbox
        keys = changes = 0
        start = len(kept)
        while start > 0 and changes < MAX_UNSENT_CHANGES:
            size = keys_in(kept[start - 1])
            if keys + size > MAX_UNSENT_KEYS:
                break
            keys, changes, start = keys + size, changes + 1, start - 1
        if start:
            log.warning("dropped %d unsent pending changes (Redis away too long)", start)
        self._outbox = kept[start:]

    async def leave(self) -> None:
        with contextlib.suppress(RedisError, OSError):
            await self.redis.zrem(self.members_key, self.member)
            await self.redis.delete(self.load_key(self.member))
            if self.flow is not None:
                await self.redis.delete(self.flow_key(self.member))

    def _unexpected(self, what: str, exc: BaseException) -> None:
        """Log a failure that is not Redis's with its traceback, once until it changes."""
        kind = f"{type(exc).__name__}: {exc}"
        if self._failing.get(what) != kind:
            log.error("%s failed unexpectedly", what, exc_info=exc)
        self._failing[what] = kind

    def _malformed(self, what: str, count: int) -> None:
        """Count what was skipped; log it the first time only (one bad table repeats every
        round)."""
        self.malformed.labels(what).inc(count)
        if what not in self._logged:
            self._logged.add(what)
            log.warning("skipped %d malformed %s from the other replicas (counted)", count, what)

    def _fall_back(self, why: str) -> None:
        if self._loads or self._remote.origins():
            log.warning("routing on this gateway's own view: %s", why)
        self.failures.inc()
        self.available.set(0)
        self._loads = {}
        self._forget_pending()
        if self.flow is not None:
            shared_flow.forget(self.flow, self.tracker.clock())

    def _forget_pending(self) -> None:
        self._remote = RemotePending(self.grace_s)

    async def _listen(self) -> None:
        while True:
            pubsub = self.redis.pubsub()
            try:
                if isinstance(self.redis, RedisCluster):
                    await self.redis.initialize()  # its pub/sub needs the slot map
                await pubsub.subscribe(self.channel)
                self.listening.set()
                self._failing.pop("the pending prompts' listener", None)
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=None)
                    if message is not None and message.get("type") == "message":
                        self._apply(message.get("data"))
            except CONNECTION_FAILURES as exc:
                if not redis_failed(exc):
                    self._unexpected("the pending prompts' listener", exc)
                self._fall_back(f"pending prompts' channel lost: {exc!r}")
            except Exception as exc:  # a bug must not leave the others' pending prompts unheard
                self._unexpected("the pending prompts' listener", exc)
                self._fall_back(f"pending prompts' listener failed: {exc!r}")
            finally:
                self.listening.clear()  # also when cancelled: nothing is heard any more
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # typed from 8.2
            await asyncio.sleep(self.interval)

    def _apply(self, data: object) -> None:
        """Another replica's pending-table changes; malformed messages and changes are
        skipped and counted."""
        parsed = parse_message(data)
        if parsed is None:
            self._malformed("pending messages", 1)
            return
        origin, changes = parsed
        if origin == self.member:
            return
        now = self.tracker.clock()
        for raw in changes:
            change = parse_change(raw)
            if change is None:
                self._malformed("pending changes", 1)
            else:
                self._remote.apply(origin, change, now)
