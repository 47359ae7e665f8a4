"""Which Redis serves which slot: one Redis serves all of them, a cluster's masters a share.

The index sends one script per master for the block keys a lookup or a batch touches (a
script may read and write any key of its node, in any slot, so long as it names one key
for the client to route by). The grouping uses redis-py's slot map, which redis-py only
corrects on a MOVED reply to the key a call is routed by. When a slot of another key of
the group moved (a reshard, `CLUSTER SETSLOT`), or is moving (a key already migrated
reads as "ask the importing node"), the node refuses that key inside the script with a
"non local key" error instead, and redis-py never learns of the move. So the calls of
one grouping run through `gather`, the one place that turns that error into `SlotMoved`
after refreshing the slot map (at most once per `REFRESH_INTERVAL`), and the caller's
next grouping follows the move.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

from redis import exceptions as redis_errors
from redis.asyncio.cluster import RedisCluster

from globalkv.index.base import IndexUnavailable
from globalkv.index.redis_failures import NON_LOCAL

_T = TypeVar("_T")
_ONE = "redis"
"""The name of one Redis's only node."""
REFRESH_INTERVAL = 0.5
"""Seconds between two refreshes of the slot map: while a slot is migrating, every call
touching it is refused, and each would otherwise ask the cluster for its whole map."""


class SlotMoved(IndexUnavailable):
    """A master refused a key of a slot it no longer serves (or is handing over)."""

    def __init__(self, message: str, regroup: bool) -> None:
        super().__init__(message)
        self.regroup = regroup
        """The slot map was refreshed since the refused grouping: grouping again may work."""


class Shards:
    def __init__(self, client: Any) -> None:
        self.cluster: RedisCluster | None = client if isinstance(client, RedisCluster) else None
        self._maps = 0
        """Slot-map refreshes so far: a grouping older than the latest may be stale."""
        self._refreshed = float("-inf")
        self._refreshing = asyncio.Lock()

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

    async def gather(self, *calls: Awaitable[_T]) -> list[_T]:
        """The calls of one grouping, concurrently; `SlotMoved` if a master refused a key
        it does not serve (see the module docstring). Other errors pass through."""
        maps = self._maps
        try:
            return list(await asyncio.gather(*calls))
        except redis_errors.ResponseError as exc:
            if self.cluster is None or not str(exc).startswith(NON_LOCAL):
                raise
            regroup = await self._refresh(maps)
            raise SlotMoved(f"a redis cluster slot moved: {exc}", regroup) from exc

    async def _refresh(self, maps: int) -> bool:
        """Refresh redis-py's slot map unless one newer than `maps` exists or the last
        refresh was too recent; whether a map newer than `maps` exists now."""
        assert self.cluster is not None
        async with self._refreshing:
            if self._maps != maps:
                return True
            if time.monotonic() - self._refreshed < REFRESH_INTERVAL:
                return False
            self._refreshed = time.monotonic()
            await self.cluster.nodes_manager.initialize()
            self._maps += 1
            return True
