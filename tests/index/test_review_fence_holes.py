"""Review of the fencing protocol (issue 16): failing tests that show holes.

Each test asserts the behaviour the design promises; each fails on main at d13e3d3.
"""

from __future__ import annotations

import pytest

from globalkv.index.base import IndexFenced, Source, SourceBatch
from globalkv.index.redis import RedisIndex
from globalkv.ingest.leases import Grant, Leases
from globalkv.redis_client import connect
from globalkv.stack.redis_cluster import LocalRedisCluster
from tests.index.events import BS, clear, depths, keys, store, tokens
from tests.index.test_redis_fences import Indexer, changed, snapshot


async def test_remove_pod_by_an_indexer_without_the_lease_leaves_no_live_generation(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RedisIndex.remove_pod (redis.py:251-269) is the one write of a fenced pod with no
    fence check, and it reads the source's generation before its MULTI without WATCH.
    `DELETE /v1/pods/x` on an indexer that does not follow x (api.py:255-261), or a late
    `clear_removed`, runs it while the holder still writes: when the holder's batch
    switches generation in between, the removal deletes the source's entry but retires
    the old generation, so the new one stays live with no source: its blocks answer
    lookups for the removed pod for good (the holder's own remove_pod finds nothing)."""
    holder_client, other_client = connect(redis_url), connect(redis_url)
    try:
        grant = await Leases(holder_client).acquire("x", "a", 30.0)
        assert isinstance(grant, Grant)
        holder = RedisIndex(holder_client, BS, fenced=True)
        holder.set_fence("x", grant.fence)
        other = RedisIndex(other_client, BS, fenced=True)  # holds no lease of x
        await holder.apply(SourceBatch(Source("x"), 0, 0.0, [store(range(1, 5), tokens(4))]))

        hgetall = other_client.hgetall

        async def racing(name: str) -> dict[bytes, bytes]:
            read = await hgetall(name)
            # The holder's next batch (the engine cleared and re-cached) lands meanwhile.
            events = [clear(), store(range(1, 5), tokens(4))]
            await holder.apply(SourceBatch(Source("x"), 1, 1.0, events))
            return read

        monkeypatch.setattr(other_client, "hgetall", racing)
        try:
            await other.remove_pod("x")
        except IndexFenced:
            return  # fenced: the holder clears x itself when it sees it left the registry
        monkeypatch.undo()
        await holder.remove_pod("x")  # the holder, told x left the registry, clears it too
        hits = await other.lookup(keys(tokens(4)))
    finally:
        await holder_client.aclose()
        await other_client.aclose()
    assert depths(hits) == {}, "a removed pod's generation is still live"


async def test_a_master_promoted_without_the_takers_copies_refuses_the_old_writer(
    redis_cluster_url: str, redis_cluster: LocalRedisCluster
) -> None:
    """redis_fences.py:22-24 names one write a lost lease can still make, after a re-copy.
    A replica promoted before it got the taker's barrier and copy (acknowledged by its
    master within the replication lag) still holds the old holder's copy, and the old
    holder's block call there passes at once, with no re-copy at all. (Its batch call is
    refused, so this is a half-batch; it is wrong in the index only where the taker does
    not rewrite those fields: with the checkpoints' blind spot, see the report.)"""
    clients = [connect(redis_cluster_url) for _ in range(2)]
    try:
        old, new = Indexer(clients[0], "old"), Indexer(clients[1], "new")
        lost = await old.take()
        await old.write(0)
        await new.take()
        victim = sorted(snapshot(redis_cluster))[0]
        node = next(n for n in redis_cluster.nodes if n.port == victim)
        with node.client(timeout=5) as client:  # the promoted replica's copies
            for key in list(client.scan_iter(match="gkv:fc:*", count=1000)):
                client.set(key, lost.fence.token)
        before = snapshot(redis_cluster)
        with pytest.raises(IndexFenced):
            await old.write(1)
        after = snapshot(redis_cluster)
    finally:
        for client in clients:
            await client.aclose()
    assert changed(before, after) == set(), "the old holder wrote on the promoted master"
