"""A throw-away Redis Cluster (3 masters, 3 replicas) on free ports, for the session.

The processes are `globalkv up --redis-cluster`'s own (`globalkv.stack.redis_cluster`);
tests empty every master through `flush` instead of starting a cluster each.
"""

from __future__ import annotations

from globalkv.stack.redis_cluster import LocalRedisCluster


def start_cluster() -> LocalRedisCluster:
    cluster = LocalRedisCluster(masters=3, replicas=1)
    cluster.start()
    return cluster


def flush(cluster: LocalRedisCluster) -> None:
    """Empty every master (their replicas follow) and forget loaded scripts."""
    for node in cluster.nodes:
        if node.port not in cluster.master_ports():
            continue
        with node.client(timeout=5) as client:
            client.flushall()
            client.script_flush()
