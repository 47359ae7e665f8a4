"""A throw-away Redis Cluster (3 masters, 3 replicas) on free ports, for the session.

The processes are `globalkv up --redis-cluster`'s own (`globalkv.stack.redis_cluster`);
tests empty every master through `flush` instead of starting a cluster each.
"""

from __future__ import annotations

from globalkv.stack.redis_cluster import ClusterNode, LocalRedisCluster


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


class SlotMove:
    """Moves one slot between masters the way `redis-cli --cluster reshard` does:
    IMPORTING on the target, MIGRATING on the source, MIGRATE of its keys (in steps, so a
    test can look between them), then SETSLOT NODE on every master."""

    def __init__(self, cluster: LocalRedisCluster, slot: int, source: int, target: int) -> None:
        self.cluster, self.slot = cluster, slot
        self.source, self.target = _node(cluster, source), _node(cluster, target)
        with self.target.client(5) as target_client:
            self.target_id = target_client.execute_command("CLUSTER", "MYID")
        with self.source.client(5) as source_client:
            self.source_id = source_client.execute_command("CLUSTER", "MYID")

    def begin(self) -> None:
        with self.target.client(5) as client:
            client.execute_command("CLUSTER", "SETSLOT", self.slot, "IMPORTING", self.source_id)
        with self.source.client(5) as client:
            client.execute_command("CLUSTER", "SETSLOT", self.slot, "MIGRATING", self.target_id)

    def keys(self) -> list[bytes]:
        """The slot's keys still on the source."""
        with self.source.client(5) as client:
            found = client.execute_command("CLUSTER", "GETKEYSINSLOT", self.slot, 100_000)
        return list(found)

    def migrate(self, keys: list[bytes]) -> None:
        if not keys:
            return
        with self.source.client(5) as client:
            client.execute_command(
                "MIGRATE", "127.0.0.1", self.target.port, "", 0, 5000, "KEYS", *keys
            )

    def finish(self) -> None:
        """The rest of the keys moved, and every master told the slot's new owner."""
        self.migrate(self.keys())
        for port in [self.target.port, self.source.port, *self.cluster.master_ports()]:
            with _node(self.cluster, port).client(5) as client:
                client.execute_command("CLUSTER", "SETSLOT", self.slot, "NODE", self.target_id)


def _node(cluster: LocalRedisCluster, port: int) -> ClusterNode:
    return next(node for node in cluster.nodes if node.port == port)
