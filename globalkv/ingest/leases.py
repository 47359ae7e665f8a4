"""Indexer membership and pod leases in Redis, with fencing tokens the index checks.

Several indexers on one Redis share the pods: each pod is followed by the one indexer that
holds its lease. A lease is a key with a TTL naming its holder and a fencing token; the
token comes from a counter that only grows, and every index write of the pod's sources
carries it (`index.base.Fence`): the apply script refuses a write whose token is not the
pod's current one, so an indexer that was paused or cut off past its TTL cannot write
after another took the pod over, even if it does not know yet that it lost the lease.
On a Redis Cluster the block writes go to other masters than the lease, so each master
holds a copy of the token, written by the taker before and after the grant (`acquire`'s
`copy`) and checked by the block writes there: `index.redis_fences`.

Keys (named in `index.redis_keys`), all under the index's hash tag, so a lease, its fence
and the index's batch checks are one slot on a Redis Cluster and the apply script reads
the fence where it writes: per pod an owner (string "<token>" with the lease TTL; gone:
the pod is free) and a fence (hash: token, the current "<n>:<holder>"; n, the counter;
holder, "<member>/<process>": `acquire`; renewed, Redis time of the last grant or renewal
in ms), and the members (sorted set: indexer id -> expiry, Redis time in ms).

The token is compared for equality, counter and holder together. The counter is the
larger of the last one plus one and Redis's time in ms, so it keeps rising after Redis
lost its data (the masters' copies compare counters: a lower one is an earlier lease).
When the Redis that lost it also came back with a clock behind the last grant, a new
holder's token counts below the copies of that grant: its first block call is refused
(`IndexFenced`), and finding the lease still its own it raises the counter past the
copies' and releases the lease (`index.redis_fences`), so its next grant counts above.

Assignment (`assign`) is rendezvous hashing with bounded load: every indexer computes it
from the same registry and the same live members, so they agree without talking; each pod
goes to the member ranking it highest among those not yet holding their share
(ceil(pods / members)), so pods are spread evenly and a join or leave moves few of them.
"""

from __future__ import annotations

import asyncio
import math
import secrets
from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import xxhash

from globalkv.index.base import Fence
from globalkv.index.redis_failures import any_failure_unavailable
from globalkv.index.redis_keys import RedisKeys
from globalkv.redis_client import Client, text

_HEARTBEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if ARGV[2] ~= '' then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local live = redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf', 'WITHSCORES')
for i = 2, #live, 2 do
  live[i] = tonumber(live[i]) - now
end
return live
"""
"""KEYS: members. ARGV: id, TTL ms ('' = only prune and list). Live ids, each followed by
the ms its heartbeat has left."""

_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local held = redis.call('GET', KEYS[1])
if held then
  local holder = redis.call('HGET', KEYS[2], 'holder') or ''
  if redis.call('HGET', KEYS[2], 'token') ~= held then
    holder = ''
  end
  if holder == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    redis.call('HSET', KEYS[2], 'renewed', now)
    return {held, -1}
  end
  if string.sub(holder, 1, #ARGV[3] + 1) ~= ARGV[3] .. '/' then
    return {false, redis.call('PTTL', KEYS[1])}
  end
end
local last = tonumber(redis.call('HGET', KEYS[2], 'renewed') or '-1')
local n = string.format('%d', math.max(tonumber(redis.call('HGET', KEYS[2], 'n') or '0') + 1, now))
redis.call('HSET', KEYS[2], 'n', n)
local token = n .. ':' .. ARGV[1]
redis.call('SET', KEYS[1], token, 'PX', ARGV[2])
redis.call('HSET', KEYS[2], 'token', token, 'holder', ARGV[1], 'renewed', now)
if last < 0 then
  return {token, -1}
end
return {token, now - last}
"""
"""KEYS: owner, fence. ARGV: holder ("<member>/<process>"), TTL ms, member. {token, ms since
the previous holder last renewed (-1: none, or the same holder)}, or {false, ms the other
holder's lease has left}. A lease held by another process of the same member (a restart
under the same id) is taken over with a new token."""

_RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
local t = redis.call('TIME')
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('HSET', KEYS[2], 'renewed', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
return 1
"""
"""KEYS: owner, fence. ARGV: token, TTL ms. 1 if still held."""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""
"""KEYS: owner. ARGV: token. A released pod is free at once (no TTL to wait out)."""


@dataclass(frozen=True, slots=True)
class Held:
    """Someone else holds the lease, for `expires_in` seconds more unless renewed."""

    expires_in: float


@dataclass(frozen=True, slots=True)
class Grant:
    """A lease just acquired (or found still held by us)."""

    fence: Fence
    unfollowed: float | None
    """Seconds since the previous holder last renewed, when the pod changed hands: an upper
    bound on the time nobody followed it. None when nobody held it before, or we did."""


class Leases:
    """The lease and membership operations; Redis errors become `IndexUnavailable`."""

    def __init__(self, redis: Client, *, prefix: str = "gkv") -> None:
        self.redis = redis
        self.keys = RedisKeys(prefix)
        self._heartbeat = redis.register_script(_HEARTBEAT)
        self._acquire = redis.register_script(_ACQUIRE)
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)
        self.process = secrets.token_hex(4)
        """This process's part of the holder: a restart under the same member id is
        another holder."""

    async def heartbeat(self, member: str, ttl: float) -> dict[str, float]:
        """Announce `member` alive for `ttl` seconds; every live member, with the seconds
        its heartbeat has left."""
        with _reachable("heartbeat"):
            live = await self._heartbeat(keys=[self.keys.indexers], args=[member, _ms(ttl)])
        return _members(live)

    async def leave(self, member: str) -> None:
        with _reachable("leaving"):
            await self.redis.zrem(self.keys.indexers, member)

    async def members(self) -> list[str]:
        with _reachable("listing indexers"):
            live = await self._heartbeat(keys=[self.keys.indexers], args=["", ""])
        return sorted(_members(live))

    async def acquire(
        self,
        pod: str,
        member: str,
        ttl: float,
        *,
        copy: Callable[[str], Awaitable[None]] | None = None,
    ) -> Grant | Held:
        """The pod's lease for this process of `member`, or how long the other holder's
        lease has left.

        The holder is "<member>/<process>" (`process`: random per `Leases`), so a process
        restarted under the same member id while the old one lives (paused, say) takes
        the lease over with a new token instead of writing under the old one's.

        `copy(token)` puts a token in every copy of the pod's fence (a Redis Cluster's
        masters each check one: `index.redis_fences`): when the lease is free or another
        process of `member` holds it, first a barrier "<n>:" below every token the grant
        may give and above every earlier one, and after the grant the granted token, so
        the grant returns once no master accepts an earlier holder's writes."""
        if not member or ":" in member or "/" in member:
            raise ValueError(f"an indexer id may hold neither ':' nor '/': {member!r}")
        holder = f"{member}/{self.process}"
        keys = [self.keys.lease_owner(pod), self.keys.lease_fence(pod)]
        if copy is not None:
            with _reachable("reading a lease"):
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.get(keys[0])
                    pipe.hget(keys[1], "n")
                    owner, last = await pipe.execute()
            previous = None if owner is None else text(owner).partition(":")[2]
            if previous is None or (previous != holder and _member(previous) == member):
                await copy(f"{int(last or 0) + 1}:")
        with _reachable("acquiring a lease"):
            token, ms = await self._acquire(keys=keys, args=[holder, _ms(ttl), member])
        if token is None:
            return Held(max(0, ms) / 1000)
        if copy is not None:
            await copy(text(token))
        unfollowed = None if ms < 0 else ms / 1000
        return Grant(Fence(self.keys.lease_fence(pod), text(token), keys[0]), unfollowed)

    async def renew(self, fences: dict[str, Fence], ttl: float) -> set[str]:
        """Extend every lease we hold; the pods whose lease is still ours."""
        if not fences:
            return set()
        pods = sorted(fences)
        with _reachable("renewing leases"):
            held = await asyncio.gather(
                *(
                    self._renew(
                        keys=[self.keys.lease_owner(pod), self.keys.lease_fence(pod)],
                        args=[fences[pod].token, _ms(ttl)],
                    )
                    for pod in pods
                )
            )
        return {pod for pod, ok in zip(pods, held, strict=True) if ok}

    async def release(self, pod: str, fence: Fence) -> None:
        with _reachable("releasing a lease"):
            await self._release(keys=[self.keys.lease_owner(pod)], args=[fence.token])

    async def owners(self, pods: Sequence[str]) -> dict[str, str]:
        """The holder of each pod's lease, for the pods that have one."""
        if not pods:
            return {}
        with _reachable("reading leases"):
            async with self.redis.pipeline(transaction=False) as pipe:
                for pod in pods:
                    pipe.get(self.keys.lease_owner(pod))
                tokens = await pipe.execute()
        return {
            pod: _member(text(token).partition(":")[2])
            for pod, token in zip(pods, tokens, strict=True)
            if token is not None
        }


def assign(pods: Iterable[str], members: Sequence[str]) -> dict[str, str]:
    """Each pod's indexer: rendezvous hashing, at most ceil(pods / members) per member."""
    pods = sorted(set(pods))
    if not members or not pods:
        return {}
    share = math.ceil(len(pods) / len(members))
    load = dict.fromkeys(members, 0)
    owners: dict[str, str] = {}
    for pod in pods:
        ranked = sorted(members, key=lambda m: (-_weight(m, pod), m))
        chosen = next(m for m in ranked if load[m] < share)
        load[chosen] += 1
        owners[pod] = chosen
    return owners


def _members(reply: Sequence[bytes | str | int]) -> dict[str, float]:
    pairs = zip(reply[::2], reply[1::2], strict=True)
    return {text(m): int(ms) / 1000 for m, ms in pairs if isinstance(m, bytes | str)}


def _member(holder: str) -> str:
    """The member id of a holder "<member>/<process>"."""
    return holder.rpartition("/")[0] or holder


def _weight(member: str, pod: str) -> int:
    return xxhash.xxh3_64_intdigest(f"{member}\0{pod}".encode())


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _reachable(what: str) -> AbstractContextManager[None]:
    """Redis errors as `IndexUnavailable`: the caller treats a lease it cannot confirm as
    one it may be losing."""
    return any_failure_unavailable(f"redis unreachable while {what}")
