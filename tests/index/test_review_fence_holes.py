"""Review of the fencing protocol (issue 16): failing tests that show holes.

Each test asserts the behaviour the design promises; each fails on main at d13e3d3.
"""

from __future__ import annotations

import pytest

from globalkv.index.base import IndexFenced
from globalkv.redis_client import connect
from globalkv.stack.redis_cluster import LocalRedisCluster
from tests.index.test_redis_fences import Indexer, changed, snapshot


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
