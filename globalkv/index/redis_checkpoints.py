"""Write checkpoints: finding the block writes a Redis Cluster failover lost.

A master acknowledges a write before its replica has it; when the master dies, the
promoted replica may lack the last writes. On one Redis the apply script's checks catch
lost data (the dataset marker, the source's batch count), but on a cluster those live on
one master and the blocks on others. So every block call also increments a counter of
this writer on the call's slot (`<prefix>:ck:{<slot tag>}<writer>`), and the writer remembers
the value each call returned. A replica holds a prefix of its master's writes, and a
script's writes replicate together, so a counter that reads lower than remembered means
acknowledged block writes on that master are gone, and with them the truth of what the
sources written there since the last check hold. The check runs before the next batch
once a call met an unavailable cluster (a failover shows as one); the sources found are
reset (hidden at once) and `IndexDataLost` makes ingest resync them.

What it cannot trace: a check forgets who wrote before it, so writes a master had
acknowledged just before a check but not yet passed to its replica, lost when that master
dies right after, name no source. That needs a check (it follows an unavailable call)
and then the master's death within its replication lag; `WAIT` after an increment on
each master would close it, at a round trip per master per check.
"""

from __future__ import annotations

import secrets
from typing import Any

from globalkv.index.base import Source
from globalkv.index.redis_keys import RedisKeys

TTL = 86_400
"""Seconds a counter outlives its writer's last write there (a writer restart starts new ones)."""


class Checkpoints:
    """One writer's counters, the values it was told, and who wrote since the last check."""

    def __init__(self, keys: RedisKeys) -> None:
        self.keys = keys
        self.writer = secrets.token_hex(4)
        self.suspect = False
        """A call met an unavailable cluster: check before writing again."""
        self._told: dict[int, int] = {}
        self._since: dict[int, set[Source]] = {}
        self._pending: set[Source] = set()
        """Sources found lost and not reset yet."""

    def name(self, slot: int) -> str:
        return self.keys.checkpoint(slot, self.writer)

    def wrote(self, slot: int, value: int, source: Source) -> None:
        self._told[slot] = max(value, self._told.get(slot, 0))
        self._since.setdefault(slot, set()).add(source)

    def reset(self, source: Source) -> None:
        """`source`, found lost, is reset: the next check no longer names it."""
        self._pending.discard(source)

    async def lost(self, client: Any) -> set[Source]:
        """The sources whose acknowledged block writes a master no longer holds, with
        those found by earlier checks and not `reset` yet."""
        slots = list(self._since)
        values = []
        if slots:
            pipe = client.pipeline(transaction=False)
            for slot in slots:
                pipe.get(self.name(slot))
            values = await pipe.execute()
        lost = self._pending
        for slot, raw in zip(slots, values, strict=True):
            now = int(raw or 0)
            if now < self._told[slot]:
                lost |= self._since[slot]
            self._told[slot] = now
        self._since.clear()
        self.suspect = False
        return set(lost)
