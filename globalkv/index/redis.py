"""The shared index in Redis or a Redis Cluster: any number of gateways read it, one
indexer writes it.

Key names and layout: `redis_keys.py`. The rule: a lookup is one script call per master
its blocks are on and a batch one per master it changes plus one that checks and commits
it (on one Redis, one call each, a batch atomic), because routing pays every round trip
on every request. How lookups, generations, writes, fingerprints, data-loss checks and
fences follow from it, and what a lookup sees mid-batch, in a failover or a resharding:
docs/redis-cluster.md. Redis must run with `maxmemory-policy noeviction`.

The client must use `decode_responses=False`: the reverse log is binary.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from redis.asyncio.cluster import RedisCluster

from globalkv.index.base import (
    ApplyResult,
    Fence,
    Hit,
    IndexDataLost,
    IndexFenced,
    IndexUnavailable,
    Source,
    SourceBatch,
    SourceStats,
    Tier,
)
from globalkv.index.packing import EngineBlock
from globalkv.index.redis_batch import Writer, apply_args, seq_ts, source_stats
from globalkv.index.redis_checkpoints import Checkpoints
from globalkv.index.redis_failures import reachable
from globalkv.index.redis_fences import ClusterWrites, fence_of
from globalkv.index.redis_keys import RedisKeys, check_layout, parse_source_name, source_name
from globalkv.index.redis_log import drop_generation, read_log, retire_pod
from globalkv.index.redis_reads import lookup
from globalkv.index.redis_scripts import APPLY, replay_log
from globalkv.index.redis_shards import Shards
from globalkv.index.scoring import TierWeights
from globalkv.index.state import SourceState
from globalkv.keys import BlockKey, EngineHash
from globalkv.redis_client import Client, text

log = logging.getLogger(__name__)


class RedisIndex:
    """An `Index` in a (shared) Redis; see the module docstring for the layout."""

    def __init__(
        self,
        redis: Client,
        block_size: int,
        *,
        tier_weights: Mapping[Tier, float] | None = None,
        prefix: str = "gkv",
        fenced: bool = False,
    ) -> None:
        """`fenced`: writes of a pod need its lease's fence (`set_fence`)."""
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        options = (
            redis.get_connection_kwargs()
            if isinstance(redis, RedisCluster)
            else redis.connection_pool.connection_kwargs
        )
        if options.get("decode_responses"):
            raise ValueError("RedisIndex needs a client with decode_responses=False")
        self.block_size = block_size
        self.keys = RedisKeys(prefix)
        self._redis = redis
        self._shards = Shards(redis)
        self._checks = Checkpoints(self.keys)
        self._blocks = ClusterWrites(redis, self.keys, self._shards, self._checks)
        self._weights = TierWeights(tier_weights)
        self._writers: dict[Source, Writer] = {}
        self._locks: dict[Source, asyncio.Lock] = {}
        self._token: bytes | None = None
        self._layout_checked = False
        self.fenced = fenced
        self._fences: dict[str, Fence] = {}

    def set_fence(self, pod: str, fence: Fence | None) -> None:
        """The lease this process writes `pod` under from now on; None: it may not write it."""
        if fence is None:
            self._fences.pop(pod, None)
        else:
            self._fences[pod] = fence
        # Another writer may have written the pod while we did not hold it: reload.
        for source in [s for s in self._writers if s.pod == pod]:
            del self._writers[source]

    async def copy_fence(self, pod: str, token: str) -> None:
        """On a cluster, `token` to every master's copy of the pod's fence (`Leases.acquire`'s
        `copy`): each master's block writes check their copy."""
        if self.fenced:
            await self._blocks.copy(pod, token)

    # -------------------------------------------------------------------- reads

    async def lookup(self, keys: Sequence[BlockKey]) -> list[Hit]:
        if not keys:
            return []
        if not self._layout_checked:
            with reachable("checking the layout"):
                await check_layout(self._redis, self.keys)
            self._layout_checked = True
        with reachable("looking up"):
            return await lookup(self._redis, self._shards, self.keys, keys, self._weights)

    async def stats(self, pod: str | None = None) -> list[SourceStats]:
        with reachable("reading statistics"):
            sources = await self._redis.hgetall(self.keys.sources)
            chosen = sorted((parse_source_name(text(n)), int(g)) for n, g in sources.items())
            chosen = [(s, g) for s, g in chosen if pod is None or s.pod == pod]
            pipe = self._redis.pipeline(transaction=False)
            for _, gen in chosen:
                pipe.hgetall(self.keys.info(gen))
            infos = await pipe.execute() if chosen else []
        return [source_stats(s, gen, info) for (s, gen), info in zip(chosen, infos, strict=True)]

    # ------------------------------------------------------------------- writes

    async def apply(self, batch: SourceBatch) -> ApplyResult:
        if self._checks.suspect:
            await self._check_writes()
        source = batch.source
        async with self._lock(source):
            fence = fence_of(self.fenced, self._fences, source.pod)
            writer = await self._writer(source)
            state = writer.state
            result = ApplyResult()
            changes = state.apply(batch.events, self.block_size, result)
            old = writer.gen
            try:
                with reachable("applying a batch"):
                    target = await self._new_gen() if changes.cleared or old is None else None
                    args, writes, logged = apply_args(
                        self.keys,
                        self._token,
                        source,
                        writer,
                        changes,
                        target,
                        batch.seq,
                        batch.ts,
                        inline=self._shards.cluster is None,
                        fence=_fence_args(fence),
                    )
                    if self._shards.cluster is not None and writes.names:
                        await self._blocks.write(writes, source, fence)
                    await self._run_apply(args)
            except IndexUnavailable as exc:
                # A failover shows as an unavailable cluster; a loss already found does not.
                self._checks.suspect |= not isinstance(exc, IndexDataLost)
                self._writers.pop(source, None)  # Redis may hold the batch or not: reload
                raise
            except BaseException:
                self._writers.pop(source, None)  # Redis may hold the batch or not: reload
                raise
            writer.log_records = logged
            if target is None:
                writer.version += 1
            else:
                writer.gen, writer.version, state.epoch = target, 1, target
            state.last_seq, state.last_ts = batch.seq, batch.ts
            if target is not None and old is not None:
                await self._drop_dead_later_if_down()
            return result

    async def reset_source(self, source: Source) -> None:
        await self._reset(source, fence_of(self.fenced, self._fences, source.pod))

    async def _reset(self, source: Source, fence: Fence | None) -> None:
        """Retire the source's generation for a fresh, empty one. Without a fence on a
        fenced index the reset is made whoever holds the pod (`_check_writes`), and this
        writer keeps no state of the source."""
        async with self._lock(source):
            await self._ensure_marker()
            name = source_name(source)
            with reachable("resetting a source"):
                gen = await self._redis.hget(self.keys.sources, name)
                info = {} if gen is None else await self._redis.hgetall(self.keys.info(int(gen)))
                target = await self._new_gen()
            state = SourceState(epoch=target, resets=int(info.get(b"resets", 0)) + 1)
            state.last_seq, state.last_ts = seq_ts(info)
            writer = Writer(state, gen=None, version=0)
            args, _, _ = apply_args(
                self.keys,
                self._token,
                source,
                writer,
                None,
                target,
                state.last_seq,
                state.last_ts,
                inline=True,
                fence=_fence_args(fence),
            )
            self._writers.pop(source, None)
            with reachable("resetting a source"):
                await self._run_apply(args)
            if fence is not None or not self.fenced:
                self._writers[source] = Writer(state, target, 1)
            await self._drop_dead_later_if_down()

    async def remove_pod(self, pod: str) -> None:
        """Unfenced, as a reset: it only hides data, so an indexer that does not hold the
        pod may remove it (`DELETE /v1/pods`); a holder's next batch then finds 'stale'."""
        mine = sorted(s for s in self._writers if s.pod == pod)
        async with contextlib.AsyncExitStack() as held:
            for source in mine:
                await held.enter_async_context(self._lock(source))
            with reachable("removing a pod"):
                retired = await retire_pod(self._redis, self.keys, pod)
            gone = {*mine, *map(parse_source_name, retired)}
            for source in gone:
                self._writers.pop(source, None)
        for source in gone:
            self._locks.pop(source, None)
        await self._drop_dead_later_if_down()

    async def close(self) -> None:
        """Forget the writer caches; the injected client belongs to its creator."""
        self._writers.clear()

    # ---------------------------------------------------------------- internals

    def _lock(self, source: Source) -> asyncio.Lock:
        lock = self._locks.get(source)
        if lock is None:
            lock = self._locks[source] = asyncio.Lock()
        return lock

    async def _ensure_marker(self) -> None:
        """Adopt the dataset's marker (creating it on an empty Redis) before writing."""
        if self._token is not None:
            return
        with reachable("reading the dataset marker"):
            await check_layout(self._redis, self.keys)
            self._layout_checked = True
            for _ in range(3):
                await self._redis.set(self.keys.marker, secrets.token_hex(8), nx=True)
                token = await self._redis.get(self.keys.marker)
                if token is not None:
                    self._token = token.encode() if isinstance(token, str) else token
                    break
            else:
                raise IndexUnavailable("redis keeps dropping the index's dataset marker")
        await self._drop_dead()  # left behind by a writer that stopped half-way

    async def _writer(self, source: Source) -> Writer:
        writer = self._writers.get(source)
        if writer is not None:
            return writer
        await self._ensure_marker()
        with reachable("loading a source"):
            raw_gen = await self._redis.hget(self.keys.sources, source_name(source))
            if raw_gen is None:
                writer = Writer(SourceState(), None, 0)
            else:
                writer = await self._load(int(raw_gen))
        self._writers[source] = writer
        return writer

    async def _load(self, gen: int) -> Writer:
        info = await self._redis.hgetall(self.keys.info(gen))
        blocks: dict[EngineHash, EngineBlock] = {}
        records = 0
        try:
            async for entries in read_log(self._redis, self.keys, gen):
                for engine_hash, block in replay_log(entries):
                    records += 1
                    if block is None:
                        blocks.pop(engine_hash, None)
                    else:
                        blocks[engine_hash] = block
        except ValueError as exc:
            raise IndexDataLost(f"generation {gen} has a corrupt reverse log: {exc}") from exc
        state = SourceState.restore(blocks.items(), epoch=gen, resets=int(info.get(b"resets", 0)))
        state.last_seq, state.last_ts = seq_ts(info)
        return Writer(state, gen, int(info.get(b"v", 0)), records)

    async def _new_gen(self) -> int:
        return await self._redis.incr(self.keys.next_gen)

    async def _check_writes(self) -> None:
        """After the cluster was unavailable: hide the sources a failover lost writes of.

        Each is reset on its own, without a fence: a reset only hides data (the source's
        generation is retired, its entries vanish from lookups), so it needs no lease. A
        source of a pod this indexer no longer holds is reset too, and its holder's next
        batch call finds the generation changed ('stale': `IndexDataLost`) and resyncs it.
        A source not reset yet (Redis failed meanwhile) stays pending for the next check.
        So only `IndexDataLost`, naming the sources, or `IndexUnavailable` leaves here,
        never the `IndexFenced` of another pod.
        """
        with reachable("checking for lost writes"):
            lost = await self._checks.lost(self._redis)
        if not lost:
            return
        for source in sorted(lost):
            try:
                await self._reset(source, None)
            except IndexUnavailable as exc:
                if isinstance(exc, IndexDataLost):
                    raise  # Redis lost everything: ingest resyncs every source
                self._checks.suspect = True  # retry the pending ones before the next write
                raise
            self._checks.reset(source)
        self._writers.clear()
        raise IndexDataLost(
            f"a Redis Cluster failover lost block writes of {len(lost)} sources: reset", lost
        )

    async def _run_apply(self, args: list[Any]) -> None:
        status = await APPLY.run(self._redis, (self.keys.marker,), args)
        if status == b"ok":
            return
        if status == b"fenced":
            raise IndexFenced(f"pod {args[6].rpartition('@')[0]}: its lease was taken over")
        self._writers.clear()
        self._token = None
        if status == b"lost":
            raise IndexDataLost("redis lost the index (restarted empty or flushed)")
        raise IndexDataLost("redis holds another history for this source (lost writes?)")

    async def _drop_dead_later_if_down(self) -> None:
        """After a generation was retired: it is hidden already, so a failure to drop its
        blocks now must not fail the call; the dead set keeps it for the next attempt."""
        try:
            await self._drop_dead()
        except IndexUnavailable as exc:
            log.warning("retired generations stay in redis until it answers again: %s", exc)

    async def _drop_dead(self) -> None:
        """Drop the blocks of every retired generation, in chunks, then the generation."""
        with reachable("dropping retired generations"):
            for raw in await self._redis.smembers(self.keys.dead):
                await drop_generation(self._redis, self.keys, self._shards, int(raw))


def _fence_args(fence: Fence | None) -> tuple[str, str]:
    return ("", "") if fence is None else (fence.key, fence.token)
