"""Leases, membership and assignment on a real Redis, and the index's fence check."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

import pytest
import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.cluster import key_slot

from globalkv.index.base import IndexDataLost, IndexFenced, IndexUnavailable, Source, SourceBatch
from globalkv.index.redis import RedisIndex
from globalkv.index.redis_keys import RedisKeys
from globalkv.indexer import IndexerConfig
from globalkv.ingest.leases import Grant, Held, Leases, assign
from globalkv.redis_client import Client, connect
from tests.index.events import BS, clear, depths, keys, store, tokens
from tests.support.redis import write_torn


@pytest.fixture(params=["redis_url", "redis_cluster_url"])
async def client(request: pytest.FixtureRequest) -> AsyncIterator[Client]:
    """A single Redis and a Redis Cluster: a lease and its fence share one slot."""
    client = connect(request.getfixturevalue(request.param))
    yield client
    await client.aclose()


def test_assignment_is_even_deterministic_and_moves_little_on_a_join() -> None:
    pods = [f"pod-{i}" for i in range(30)]
    three = assign(pods, ["a", "b", "c"])
    assert set(three) == set(pods)
    assert sorted(Counter(three.values()).values()) == [10, 10, 10]
    assert assign(reversed(pods), ["c", "a", "b"]) == three  # same inputs, any order
    four = assign(pods, ["a", "b", "c", "d"])
    assert max(Counter(four.values()).values()) == 8  # ceil(30 / 4)
    moved = [p for p in pods if four[p] != three[p]]
    assert len(moved) < len(pods) // 2  # a join moves some pods, not most
    assert Counter(four[p] for p in moved)["d"] >= len(moved) // 2
    assert assign(pods, []) == {}


def test_a_lease_its_fence_and_the_index_checks_share_a_hash_slot() -> None:
    leases = Leases(aioredis.Redis(), prefix="gkv")
    meta = key_slot(RedisKeys("gkv").marker.encode())
    for pod in ("p0", "host:8000", "[::1]:30000", "{odd}"):
        assert key_slot(leases.keys.lease_owner(pod).encode()) == meta
        assert key_slot(leases.keys.lease_fence(pod).encode()) == meta


async def test_leases_are_exclusive_renewed_released_and_fenced_on_takeover(
    client: Client,
) -> None:
    leases = Leases(client, prefix="t")
    first = await leases.acquire("p0", "ix-a", ttl=5.0)
    assert isinstance(first, Grant)
    assert first.unfollowed is None
    held = await leases.acquire("p0", "ix-b", ttl=5.0)
    assert isinstance(held, Held)
    assert 0 < held.expires_in <= 5.0
    again = await leases.acquire("p0", "ix-a", ttl=5.0)  # idempotent for the holder
    assert isinstance(again, Grant)
    assert again.fence == first.fence
    assert await leases.owners(["p0", "p1"]) == {"p0": "ix-a"}
    assert await leases.renew({"p0": first.fence}, ttl=5.0) == {"p0"}

    await client.delete(leases.keys.lease_owner("p0"))  # the TTL ran out
    taken = await leases.acquire("p0", "ix-b", ttl=5.0)
    assert isinstance(taken, Grant)
    assert taken.fence.token != first.fence.token
    assert taken.unfollowed is not None
    assert taken.unfollowed >= 0
    assert await leases.renew({"p0": first.fence}, ttl=5.0) == set()
    await leases.release("p0", first.fence)  # not ours any more: no effect
    assert await leases.owners(["p0"]) == {"p0": "ix-b"}
    await leases.release("p0", taken.fence)
    assert await leases.owners(["p0"]) == {}


async def test_tokens_keep_rising_after_redis_lost_the_leases(client: Client) -> None:
    """The masters' fence copies compare counters: a counter that started again at 1 would
    be fenced by the copies of the leases before the loss."""
    leases = Leases(client, prefix="t")
    first = await leases.acquire("p0", "ix-a", ttl=5.0)
    assert isinstance(first, Grant)
    await client.delete(leases.keys.lease_owner("p0"))
    await client.delete(leases.keys.lease_fence("p0"))  # Redis came back empty
    seconds, micros = await client.time()
    second = await leases.acquire("p0", "ix-b", ttl=5.0)
    assert isinstance(second, Grant)
    counter = int(second.fence.token.partition(":")[0])
    assert counter >= seconds * 1000 + micros // 1000
    assert counter >= int(first.fence.token.partition(":")[0])


async def test_a_lease_expires_by_its_ttl(client: Client) -> None:
    leases = Leases(client, prefix="t")
    grant = await leases.acquire("p0", "ix-a", ttl=5.0)
    assert isinstance(grant, Grant)
    ttl_ms = await client.pttl(leases.keys.lease_owner("p0"))
    assert 0 < ttl_ms <= 5000


async def test_membership_lists_live_members_and_forgets_the_departed(
    client: Client,
) -> None:
    leases = Leases(client, prefix="t")
    assert list(await leases.heartbeat("ix-a", ttl=5.0)) == ["ix-a"]
    live = await leases.heartbeat("ix-b", ttl=5.0)
    assert sorted(live) == ["ix-a", "ix-b"]
    assert all(0 < left <= 5.0 for left in live.values())
    await client.zadd(leases.keys.indexers, {"ix-dead": 1})  # its heartbeat expired long ago
    assert await leases.members() == ["ix-a", "ix-b"]
    await leases.leave("ix-a")
    assert await leases.members() == ["ix-b"]


async def test_the_index_refuses_writes_without_the_current_fence(
    client: Client,
) -> None:
    leases = Leases(client, prefix="gkv")
    old = RedisIndex(client, BS, fenced=True)
    new = RedisIndex(client, BS, fenced=True)
    source = Source("p0")

    def batch(seq: int) -> SourceBatch:
        return SourceBatch(source, seq, 0.0, [store([100 + seq], tokens(1, 10 * seq))])

    with pytest.raises(IndexFenced):  # no lease at all
        await old.apply(batch(0))
    first = await leases.acquire("p0", "old", ttl=5.0)
    assert isinstance(first, Grant)
    old.set_fence("p0", first.fence)
    await old.apply(batch(0))

    await client.delete(leases.keys.lease_owner("p0"))  # old paused past its lease
    second = await leases.acquire("p0", "new", ttl=5.0)
    assert isinstance(second, Grant)
    new.set_fence("p0", second.fence)
    await new.apply(batch(1))
    with pytest.raises(IndexFenced):
        await old.apply(batch(2))
    with pytest.raises(IndexFenced):
        await old.reset_source(source)
    (stats,) = await new.stats("p0")
    assert stats.last_seq == 1  # the fenced writes left nothing
    await new.apply(batch(2))


async def test_an_unfenced_index_ignores_leases(client: Client) -> None:
    index = RedisIndex(client, BS)
    await index.apply(SourceBatch(Source("p0"), 0, 0.0, [store([1], tokens(1))]))
    assert [s.last_seq for s in await index.stats("p0")] == [0]


async def test_a_lost_write_check_resets_every_lost_source_also_of_a_pod_whose_lease_moved(
    client: Client,
) -> None:
    """A failover lost block writes of x and z (found by the check before y's next batch);
    x's lease moved to another indexer meanwhile. Every lost source is still reset, y's
    apply says so with `IndexDataLost` (not x's `IndexFenced`), and x's new holder is made
    to resync x by its next batch."""
    leases, index = Leases(client), RedisIndex(client, BS, fenced=True)
    for pod in ("x", "y", "z"):
        grant = await leases.acquire(pod, "a", 30.0)
        assert isinstance(grant, Grant)
        index.set_fence(pod, grant.fence)
        await index.apply(SourceBatch(Source(pod), 0, 0.0, [store(range(1, 5), tokens(4))]))
    await client.delete(leases.keys.lease_owner("x"))  # a's lease of x ran out in the outage
    taken = await leases.acquire("x", "b", 30.0)
    assert isinstance(taken, Grant)
    holder = RedisIndex(client, BS, fenced=True)
    holder.set_fence("x", taken.fence)
    await holder.apply(SourceBatch(Source("x"), 1, 1.0, [store(range(5, 7), tokens(2, start=4))]))
    # What the check finds after a failover lost block writes of x and z there.
    index._checks.wrote(0, 10**6, Source("x"))
    index._checks.wrote(0, 10**6, Source("z"))
    index._checks.suspect = True

    batch = SourceBatch(Source("y"), 1, 1.0, [store(range(10, 14), tokens(4, start=100))])
    with pytest.raises(IndexDataLost) as raised:
        await index.apply(batch)
    assert set(raised.value.sources or ()) == {Source("x"), Source("z")}
    assert [s.resets for s in await index.stats("z")] == [1]
    assert [s.resets for s in await index.stats("x")] == [1]
    await index.apply(batch)  # y itself was not lost: its batch goes in on the retry
    assert [s.last_seq for s in await index.stats("y")] == [1]
    with pytest.raises(IndexDataLost):  # x's holder finds its generation retired
        await holder.apply(SourceBatch(Source("x"), 2, 2.0, [store([9], tokens(1, 9))]))


async def test_lost_sources_not_reset_when_redis_fails_are_reset_by_the_next_check(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    leases, index = Leases(client), RedisIndex(client, BS, fenced=True)
    for pod in ("x", "y"):
        grant = await leases.acquire(pod, "a", 30.0)
        assert isinstance(grant, Grant)
        index.set_fence(pod, grant.fence)
        await index.apply(SourceBatch(Source(pod), 0, 0.0, [store(range(1, 5), tokens(4))]))
    index._checks.wrote(0, 10**6, Source("x"))
    index._checks.suspect = True
    new_gen = index._new_gen

    async def down() -> int:
        monkeypatch.setattr(index, "_new_gen", new_gen)
        raise IndexUnavailable("redis unreachable while resetting a source")

    monkeypatch.setattr(index, "_new_gen", down)
    batch = SourceBatch(Source("y"), 1, 1.0, [store([9], tokens(1, 9))])
    with pytest.raises(IndexUnavailable) as raised:
        await index.apply(batch)
    assert not isinstance(raised.value, IndexDataLost)
    with pytest.raises(IndexDataLost) as lost:  # the next check still knows x
        await index.apply(batch)
    assert lost.value.sources == {Source("x")}
    assert [s.resets for s in await index.stats("x")] == [1]


async def test_a_process_restarted_under_the_same_indexer_id_takes_the_lease_with_a_new_token(
    client: Client,
) -> None:
    """`globalkv up` names its indexers indexer-<i>: a process restarted under that name
    while the old one is paused must not write under the old one's token."""
    old, new = Leases(client), Leases(client)
    old_index, new_index = RedisIndex(client, BS, fenced=True), RedisIndex(client, BS, fenced=True)
    first = await old.acquire("x", "indexer-0", 30.0, copy=partial(old_index.copy_fence, "x"))
    assert isinstance(first, Grant)
    old_index.set_fence("x", first.fence)
    await old_index.apply(SourceBatch(Source("x"), 0, 0.0, [store(range(1, 5), tokens(4))]))

    second = await new.acquire("x", "indexer-0", 30.0, copy=partial(new_index.copy_fence, "x"))
    assert isinstance(second, Grant)
    assert second.fence.token != first.fence.token
    assert await new.owners(["x"]) == {"x": "indexer-0"}
    assert await old.renew({"x": first.fence}, ttl=30.0) == set()
    with pytest.raises(IndexFenced):  # the paused one resumes: refused on every master
        await old_index.apply(SourceBatch(Source("x"), 1, 1.0, [store([9], tokens(1, 9))]))
    assert [s.last_seq for s in await new_index.stats("x")] == [0]
    again = await new.acquire("x", "indexer-0", 30.0)  # the same process: renewed as it was
    assert isinstance(again, Grant)
    assert again.fence == second.fence
    assert isinstance(await new.acquire("x", "indexer-1", 30.0), Held)


@pytest.mark.parametrize("member", ["ix:a", "ix/a", ""])
async def test_an_indexer_id_with_a_token_separator_is_refused(member: str) -> None:
    with pytest.raises(ValueError, match="indexer id"):
        await Leases(aioredis.Redis()).acquire("x", member, 5.0)


@pytest.mark.parametrize("name", ["ix:a", "host/1"])
def test_an_indexer_id_with_a_token_separator_is_a_config_error(name: str) -> None:
    with pytest.raises(ValidationError, match="may not hold ':' or '/'"):
        IndexerConfig(indexer_id=name)
    assert IndexerConfig(indexer_id="indexer-0.a_b").member_id == "indexer-0.a_b"


async def test_a_pod_removed_by_an_indexer_without_its_lease_leaves_no_live_generation(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`DELETE /v1/pods/x` on an indexer that does not follow x, while the holder's batch
    switches x's generation (the engine cleared and re-cached) right after the remover's
    first read: the generation x has at the removal is the one retired, so nothing of x
    stays live, and the holder's next batch is refused as stale (it resyncs)."""
    leases = Leases(client)
    grant = await leases.acquire("x", "a", 30.0)
    assert isinstance(grant, Grant)
    holder, other = RedisIndex(client, BS, fenced=True), RedisIndex(client, BS, fenced=True)
    holder.set_fence("x", grant.fence)
    await holder.apply(SourceBatch(Source("x"), 0, 0.0, [store(range(1, 5), tokens(4))]))
    switched = False

    def racing(call: Callable[..., Awaitable[Any]], *, before: bool) -> Callable[..., Any]:
        async def racy(*args: Any, **kwargs: Any) -> Any:
            nonlocal switched
            if not before:
                read = await call(*args, **kwargs)
            monkeypatch.undo()  # only the remover's first call races
            await holder.apply(SourceBatch(Source("x"), 1, 1.0, [clear(), *events]))
            switched = True
            return read if not before else await call(*args, **kwargs)

        return racy

    events = [store(range(1, 5), tokens(4))]
    # The switch lands after the remover's first read, or before its first script call.
    monkeypatch.setattr(client, "hgetall", racing(client.hgetall, before=False))
    monkeypatch.setattr(client, "evalsha", racing(client.evalsha, before=True))
    await other.remove_pod("x")
    assert switched
    assert depths(await other.lookup(keys(tokens(4)))) == {}
    assert await other.stats("x") == []
    live = await client.hgetall(holder.keys.live)
    assert not any(name.startswith(b"x@") for name in live.values())
    with pytest.raises(IndexDataLost):
        await holder.apply(SourceBatch(Source("x"), 2, 2.0, [store([9], tokens(1, 9))]))


async def test_a_connection_closed_under_a_write_is_unavailable_not_a_crash(
    redis_url: str,
) -> None:
    """redis-py's AttributeError for a transport closed under a write (seen when a cluster
    master died) would have ended the indexer's lease loop, which only expects
    `IndexUnavailable`: it is one."""
    client = aioredis.Redis.from_url(redis_url, single_connection_client=True)
    leases = Leases(client)
    await leases.heartbeat("ix-a", 5.0)  # the one connection is open
    async with write_torn(client):
        with pytest.raises(IndexUnavailable, match="heartbeat: AttributeError"):
            await leases.heartbeat("ix-a", 5.0)
