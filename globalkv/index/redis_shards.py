"""Which Redis serves which slot: one Redis serves all of them, a cluster's masters a share.

The index sends one script per master for the block keys a lookup or a batch touches (a
script may read and write any key of its node, in any slot, so long as it names one key
for the client to route by). The grouping uses redis-py's slot map; when the cluster
moved a slot since, the node refuses a key it does not serve ("non local key"), which
`redis_failures` counts as unavailable: the caller retries after redis-py refreshed the
map, as it does on every MOVED.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from redis.asyncio.cluster import RedisCluster

_T = TypeVar("_T")
_ONE = "redis"
"""The name of one Redis's only node."""


class Shards:
    def __init__(self, client: Any) -> None:
        self.cluster: RedisCluster | None = client if isinstance(client, RedisCluster) else None

    def group(self, slots: Sequence[int], items: Sequence[_T]) -> list[list[_T]]:
        """`items` (item i in slot `slots[i]`) split per master, each in its given order."""
        return list(self.by_node(slots, items).values())

    def by_node(self, slots: Sequence[int], items: Sequence[_T]) -> dict[str, list[_T]]:
        """`group`, by the name of the master (`node_of`) serving each group."""
        if self.cluster is None:
            return {_ONE: list(items)} if items else {}
        node_of = self.cluster.nodes_manager.get_node_from_slot
        names: dict[int, str] = {}
        groups: dict[str, list[_T]] = {}
        for slot, item in zip(slots, items, strict=True):
            name = names.get(slot)
            if name is None:
                name = names[slot] = node_of(slot).name
            groups.setdefault(name, []).append(item)
        return groups

    def node_of(self, slot: int) -> str:
        """The name of the master serving `slot` (one name for all slots of one Redis)."""
        if self.cluster is None:
            return _ONE
        return str(self.cluster.nodes_manager.get_node_from_slot(slot).name)
