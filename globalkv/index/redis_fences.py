"""Fenced writes on a Redis Cluster: every master holds a copy of each pod's fencing token.

A pod's lease and its fence (ingest/leases.py) live on the `{p}` slot, where the batch
call checks the writer's token. On a cluster a batch's block fields go to their masters
first, in calls of their own (one per master, concurrently), so each of those calls
checks this master's copy of the pod's token and writes nothing unless it is the
writer's: an indexer whose lease was taken over writes nothing on any master.

- Taking a lease (`Leases.acquire`, through `copy`): when the lease is free (or held
  by another process under the same indexer id), a barrier
  "<n+1>:" goes to every master before the grant (n: the counter of the last token
  granted; every token granted later counts at least n+1), then the grant, then the
  granted token to every master, then ingest follows the pod. So from the grant on no
  master accepts an earlier holder's token. A taker that dies between copies leaves
  barriers or its own token, which the next taker's copies replace.
- Copies only rise: a copy is replaced by a token of a higher counter, or of the same
  counter when that is a real token and the copy a barrier. The lease counter keeps
  rising across a Redis that lost its data (leases.py), so old copies bar no new holder
  but when that Redis came back with a clock behind the last grant (below).
- A block call refuses with 'fenced' and the copy's counter when the copy counts above
  the writer's token (a later lease): `IndexFenced`. If the lease on `{p}` is still the
  writer's, its grant counted below an earlier grant's copies: the writer raises the
  lease counter past the copies' and releases the lease, so its next grant (or another
  indexer's) counts above them and the copies take it. A block call refuses with
  'recopy' when the copy is missing (a failover lost it, a reshard moved its slot, it
  expired), older, or a barrier; the writer then reads its lease on `{p}`: still its
  own, it copies its token to every master again and repeats the refused calls once
  (else `IndexFenced`).
- What a lost lease can still write: block fields on a master that lost the taker's
  barrier and copy, i.e. a replica promoted without them. There the old copy is still
  the old holder's token, so its block calls pass at once (its batch call on `{p}` is
  refused: a half batch, wrong in the index where the taker does not rewrite those
  fields). A taker makes that rare: after each master's copies it waits (`WAIT`, at
  most `COPY_WAIT_MS`) for a replica to hold them, so it takes a replica that did not
  answer within that, or the promotion of another one. Likewise a writer that read its
  lease as its own just before a takeover, when a master lost the taker's copy before
  the writer's re-copy arrived.
- Where a master's copy is: in every slot of `CANDIDATES`, a fixed set of slots spread
  over the ring (a copy is written to all of them, whichever master serves each), and a
  block call checks the first candidate its master serves. A reshard moves a copy with
  its slot, so every candidate still holds the taker's token and a writer checks one
  whichever candidate its master serves now; with a slot map older than the reshard
  the master refuses the call ("non local key", unavailable: redis_shards.py). A master
  serving no candidate (a cluster of many masters) uses the first slot it serves in
  `STRIDE` order instead, which the taker's slot map must agree on.
- One Redis: the batch call holds every write and the fence check; there are no copies.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from globalkv.index.base import Fence, IndexFenced, IndexUnavailable, Source
from globalkv.index.redis_batch import BlockWrites
from globalkv.index.redis_checkpoints import TTL, Checkpoints
from globalkv.index.redis_failures import reachable
from globalkv.index.redis_keys import SLOTS, STRIDE, RedisKeys
from globalkv.index.redis_scripts import APPLY, FENCE_COPY, FENCE_RELEASE
from globalkv.index.redis_shards import Shards
from globalkv.redis_client import Client, text

log = logging.getLogger(__name__)

CANDIDATES = tuple(k * STRIDE % SLOTS for k in range(64))
"""The slots every copy of a pod's token is written to."""
COPY_WAIT_MS = 100
"""At most this long a copy waits for a replica of its master to have it."""
COPY_TTL = 86_400
"""Seconds a copy lives unless written again; a block call meeting none has it copied anew."""


def fence_of(fenced: bool, fences: Mapping[str, Fence], pod: str) -> Fence | None:
    """The lease a write of `pod` carries (None: unfenced); `IndexFenced` without one."""
    if not fenced:
        return None
    fence = fences.get(pod)
    if fence is None:
        raise IndexFenced(f"pod {pod}: this indexer holds no lease of it")
    return fence


class ClusterWrites:
    """A batch's block calls on a cluster, one per master, each checking the pod's copy."""

    def __init__(self, redis: Client, keys: RedisKeys, shards: Shards, checks: Checkpoints):
        self._redis = redis
        self._keys = keys
        self._shards = shards
        self._checks = checks

    async def copy(self, pod: str, token: str) -> None:
        """`token` (or a barrier "<n>:") to every master's copies of the pod's fence."""
        if self._shards.cluster is None:
            return
        with reachable("copying a fence"):
            await self._shards.cluster.initialize()  # the slot map, on a new client
            masters = {node.name for node in self._shards.cluster.get_primaries()}
            slots = [*CANDIDATES, *self._fallbacks(masters)]
            names = [self._keys.fence_copy(s, pod) for s in slots]
            groups = self._shards.group(slots, list(zip(slots, names, strict=True)))
            await self._shards.gather(*(self._copy_on(g, token) for g in groups))

    async def _copy_on(self, group: list[tuple[int, str]], token: str) -> None:
        """One master's copies, then (if it has a replica: `ROLE`) `WAIT` at most
        `COPY_WAIT_MS` for one to hold them, so a replica promoted later rarely lacks
        the taker's copy. The copies and `WAIT` go on one connection, as `WAIT` counts
        the writes of its own connection."""
        assert self._shards.cluster is not None
        cluster = self._shards.cluster
        (slot, first), *rest = group
        args: list[str | int] = [token, COPY_TTL, *(name for _, name in rest)]
        node = cluster.nodes_manager.get_node_from_slot(slot)
        role = await cluster.execute_command("ROLE", target_nodes=node)
        if not role[2:] or not role[2]:  # a master without a connected replica
            await FENCE_COPY.run(self._redis, (first,), args)
            return
        pipe = cluster.pipeline(transaction=False)
        pipe.execute_command("EVAL", FENCE_COPY.source, 1, first, *args)  # no EVALSHA retry here
        pipe.execute_command("WAIT", 1, COPY_WAIT_MS, target_nodes=node)
        await pipe.execute()

    async def write(self, writes: BlockWrites, source: Source, fence: Fence | None) -> None:
        """The block calls; a failure half-way leaves the batch unlogged, so its retry
        sends them all again (they are idempotent)."""
        items = list(zip(writes.slots, writes.names, writes.values, strict=True))
        pending = self._shards.by_node(writes.slots, items)
        for attempt in range(2):
            with reachable("writing blocks"):
                replies = await self._shards.gather(
                    *(self._call(writes.gen, n, g, source.pod, fence) for n, g in pending.items())
                )
            refused: dict[str, list[tuple[int, str, str]]] = {}
            above: int | None = None
            for (node, group), reply in zip(pending.items(), replies, strict=True):
                if isinstance(reply, bytes) and reply.startswith(b"fenced:"):
                    above = max(above or 0, int(reply[len(b"fenced:") :]))
                elif reply == b"recopy":
                    refused[node] = group
                else:
                    self._checks.wrote(group[0][0], int(reply), source)
            if above is not None:
                if fence is not None:
                    await self._release_below(source.pod, fence, above)
                raise IndexFenced(f"pod {source.pod}: its lease was taken over")
            if not refused or fence is None:
                return
            if attempt == 0:
                await self._recopy(source.pod, fence)
            pending = refused
        raise IndexUnavailable(
            f"pod {source.pod}: masters {sorted(pending)} hold no copy of its fence after "
            "copying it again (is the cluster moving slots?)"
        )

    async def _call(
        self, gen: int, node: str, group: list[tuple[int, str, str]], pod: str, fence: Fence | None
    ) -> Any:
        names = "\n".join(name for _, name, _ in group)
        values = ",".join(value for _, _, value in group)
        checkpoint = self._checks.name(group[0][0])
        copy, token = ("", "") if fence is None else (self._copy_key(node, pod), fence.token)
        argv = ("blocks", gen, len(group), names, values, checkpoint, TTL, copy, token)
        return await APPLY.run(self._redis, (group[0][1],), argv)

    async def _recopy(self, pod: str, fence: Fence) -> None:
        """A master holds no copy of our token: copy it again if the lease is still ours."""
        with reachable("reading a lease"):
            current = await self._redis.hget(fence.key, "token")
        if current is None or text(current) != fence.token:
            raise IndexFenced(f"pod {pod}: its lease was taken over")
        await self.copy(pod, fence.token)

    async def _release_below(self, pod: str, fence: Fence, above: int) -> None:
        """The copies count `above` our token's. When the lease is another's, that is a
        later lease. When it is still ours, the grant counted below an earlier one's
        copies (the `{p}` master lost its data, its clock behind that grant): raise the
        counter past them and release the lease, so the next grant counts above."""
        with reachable("releasing a lease granted below the fence copies"):
            keys, args = (fence.owner, fence.key), (fence.token, above)
            if await FENCE_RELEASE.run(self._redis, keys, args):
                log.warning(
                    "pod %s: the fence copies count %d, above our lease's %s: released, "
                    "so that the next grant counts above them",
                    pod,
                    above,
                    fence.token,
                )

    def _copy_key(self, node: str, pod: str) -> str:
        """The copy a block call on `node` checks: the first candidate `node` serves."""
        node_of = self._shards.node_of
        slot = next((s for s in CANDIDATES if node_of(s) == node), None)
        if slot is None:
            slot = self._fallbacks({node})[0]
        return self._keys.fence_copy(slot, pod)

    def _fallbacks(self, masters: set[str]) -> list[int]:
        """For each of `masters` serving no candidate, the first slot it serves in STRIDE
        order (past the candidates)."""
        node_of = self._shards.node_of
        missing = masters - {node_of(s) for s in CANDIDATES}
        found = []
        k = len(CANDIDATES)
        while missing and k < SLOTS:
            slot = k * STRIDE % SLOTS
            node = node_of(slot)
            if node in missing:
                missing.discard(node)
                found.append(slot)
            k += 1
        return found
