"""Fencing on a real Redis Cluster: a writer whose lease was taken over writes nothing on
any master, also when the takeover lands between its reads and its block calls, when the
taker died between its copies, and when a master lost its copy of the token; a holder
granted below the copies recovers; a taker returns once the replicas hold its copies.
The one known hole (a replica promoted without the taker's copies) is a strict xfail."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from itertools import count
from typing import Any

import pytest
from redis.cluster import key_slot

from globalkv.index.base import IndexFenced, IndexUnavailable, Source, SourceBatch
from globalkv.index.redis import RedisIndex
from globalkv.ingest.leases import Grant, Leases
from globalkv.redis_client import Client, connect
from globalkv.stack.redis_cluster import LocalRedisCluster
from tests.index.events import BS, remove, store, tokens
from tests.support.net import await_for

POD = "p0"
SOURCE = Source(POD)
CHAIN = 6 * 16
"""Blocks of the first batch: six segments, spread over every master."""

Snapshot = dict[int, dict[bytes, bytes]]


@pytest.fixture
async def clients(redis_cluster_url: str) -> AsyncIterator[list[Client]]:
    """One client per indexer process: the stale writer's, the taker's, a third's."""
    opened = [connect(redis_cluster_url) for _ in range(3)]
    yield opened
    for client in opened:
        await client.aclose()


class Indexer:
    """What one indexer replica does with a pod: take its lease, then write it."""

    def __init__(self, client: Client, name: str) -> None:
        self.name = name
        self.leases = Leases(client)
        self.index = RedisIndex(client, BS, fenced=True)

    async def take(self, copy: Callable[[str], Awaitable[None]] | None = None) -> Grant:
        await self.leases.redis.delete(self.leases.keys.lease_owner(POD))  # the last lease ran out
        grant = await self.leases.acquire(
            POD, self.name, 5.0, copy=copy or functools.partial(self.index.copy_fence, POD)
        )
        assert isinstance(grant, Grant)
        self.index.set_fence(POD, grant.fence)
        return grant

    async def write(self, seq: int) -> None:
        """Batch `seq`: the first stores a long chain, later ones extend it and evict."""
        if seq == 0:
            events = [store(range(1, CHAIN + 1), tokens(CHAIN))]
        else:
            first = CHAIN + 20 * seq
            events = [
                store(range(first, first + 20), tokens(20, start=10_000 * seq)),
                remove(range(seq * 10, seq * 10 + 10)),
            ]
        await self.index.apply(SourceBatch(SOURCE, seq, float(seq), events))


def snapshot(cluster: LocalRedisCluster) -> Snapshot:
    """Every key of every master, serialized (DUMP): any write anywhere changes it."""
    out: Snapshot = {}
    for node in cluster.nodes:
        if node.port not in cluster.master_ports():
            continue
        with node.client(timeout=5) as client:
            out[node.port] = {key: client.dump(key) for key in client.scan_iter(count=1000)}
    return out


def changed(before: Snapshot, after: Snapshot) -> set[bytes]:
    """The keys whose value differs between two snapshots, on any master."""
    out = set()
    for port in before.keys() | after.keys():
        one, two = before.get(port, {}), after.get(port, {})
        out |= {k for k in one.keys() | two.keys() if one.get(k) != two.get(k)}
    return out


def block_keys(shot: Snapshot) -> dict[int, int]:
    return {port: sum(k.startswith(b"gkv:b:") for k in keys) for port, keys in shot.items()}


def drop_copies(cluster: LocalRedisCluster, port: int) -> int:
    """Delete the fence copies on one master, as a failover that lost them would."""
    node = next(n for n in cluster.nodes if n.port == port)
    with node.client(timeout=5) as client:
        found = list(client.scan_iter(match="gkv:fc:*", count=1000))
        return sum(int(client.delete(key)) for key in found)  # one slot per call


async def test_a_writer_whose_lease_was_taken_over_writes_nothing_on_any_master(
    clients: list[Client], redis_cluster: LocalRedisCluster
) -> None:
    old, new = Indexer(clients[0], "old"), Indexer(clients[1], "new")
    await old.take()
    await old.write(0)
    before = snapshot(redis_cluster)
    assert all(count > 0 for count in block_keys(before).values()), "a master without blocks"

    await new.take()
    before = snapshot(redis_cluster)
    with pytest.raises(IndexFenced):
        await old.write(1)
    assert snapshot(redis_cluster) == before
    with pytest.raises(IndexFenced):
        await old.index.reset_source(SOURCE)
    # A reset draws its new generation id first: a stale one burns an id, writes nothing.
    assert changed(before, snapshot(redis_cluster)) == {b"{gkv}:index:gen:next"}
    await new.write(1)  # the new holder writes
    (stats,) = await new.index.stats(POD)
    assert stats.last_seq == 1


async def test_a_takeover_between_a_writers_reads_and_its_block_calls_fences_them_all(
    clients: list[Client], redis_cluster: LocalRedisCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The takeover lands after the stale writer built its batch (its fence, its state),
    as its block calls leave for the masters."""
    old, new = Indexer(clients[0], "old"), Indexer(clients[1], "new")
    await old.take()
    await old.write(0)
    shots: list[Snapshot] = []

    async def take_over() -> None:
        await new.take()
        shots.append(snapshot(redis_cluster))

    takeover: list[asyncio.Task[None]] = []
    evalsha = clients[0].evalsha

    async def racing(sha: str, numkeys: int, *keys_and_args: Any) -> Any:
        if keys_and_args[numkeys] == "blocks":
            if not takeover:
                takeover.append(asyncio.ensure_future(take_over()))
            await takeover[0]
        return await evalsha(sha, numkeys, *keys_and_args)

    monkeypatch.setattr(clients[0], "evalsha", racing)
    with pytest.raises(IndexFenced):
        await old.write(1)
    assert len(shots) == 1, "the block calls never ran"
    assert snapshot(redis_cluster) == shots[0]
    await new.write(1)


async def test_a_taker_that_died_between_its_copies_leaves_the_old_writer_fenced(
    clients: list[Client], redis_cluster: LocalRedisCluster
) -> None:
    """The barrier went to every master before the grant; the granted token to none."""
    old, dying, third = (
        Indexer(c, n) for c, n in zip(clients, ("old", "dying", "third"), strict=True)
    )
    await old.take()
    await old.write(0)

    async def barrier_only(token: str) -> None:
        if token.endswith(":"):
            await dying.index.copy_fence(POD, token)

    await dying.take(copy=barrier_only)
    before = snapshot(redis_cluster)
    with pytest.raises(IndexFenced):
        await old.write(1)
    assert snapshot(redis_cluster) == before

    await third.take()  # the dead taker's lease ran out
    await third.write(1)
    with pytest.raises(IndexFenced):
        await dying.write(1)  # had it lived: its token is below the third's on every master


async def test_a_master_that_lost_its_copy_refuses_until_the_holder_copies_it_again(
    clients: list[Client], redis_cluster: LocalRedisCluster
) -> None:
    old, new = Indexer(clients[0], "old"), Indexer(clients[1], "new")
    await old.take()
    await old.write(0)
    await new.take()
    victim = sorted(snapshot(redis_cluster))[0]
    assert drop_copies(redis_cluster, victim) > 0

    before = snapshot(redis_cluster)
    with pytest.raises(IndexFenced):  # missing there, later elsewhere: refused everywhere
        await old.write(1)
    assert snapshot(redis_cluster) == before

    await new.write(1)  # its lease is still its own: copied again, then written
    copies = [k for k in snapshot(redis_cluster)[victim] if k.startswith(b"gkv:fc:")]
    assert copies
    (stats,) = await new.index.stats(POD)
    assert stats.last_seq == 1


async def test_a_copy_only_rises(clients: list[Client], redis_cluster: LocalRedisCluster) -> None:
    index = RedisIndex(clients[0], BS, fenced=True)

    def copies() -> set[bytes]:
        values = set()
        for port, keys in snapshot(redis_cluster).items():
            node = next(n for n in redis_cluster.nodes if n.port == port)
            with node.client(timeout=5) as client:
                values |= {client.get(k) for k in keys if k.startswith(b"gkv:fc:")}
        return values

    await index.copy_fence(POD, "7:b")
    await index.copy_fence(POD, "6:a")  # an earlier lease
    await index.copy_fence(POD, "7:")  # a barrier of the same counter
    assert copies() == {b"7:b"}
    await index.copy_fence(POD, "8:")
    assert copies() == {b"8:"}
    await index.copy_fence(POD, "8:c")
    assert copies() == {b"8:c"}


def _move_slot(cluster: LocalRedisCluster, slot: int, source: int, target: int) -> None:
    """Reshard `slot` (its keys with it) from master port `source` to `target`, as
    `redis-cli --cluster reshard` does."""
    nodes = {n.port: n for n in cluster.nodes}
    with nodes[source].client(timeout=5) as src, nodes[target].client(timeout=5) as dst:
        src_id, dst_id = src.execute_command("CLUSTER MYID"), dst.execute_command("CLUSTER MYID")
        dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
        while keys := src.execute_command("CLUSTER GETKEYSINSLOT", slot, 100):
            src.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *keys)
    for port in cluster.master_ports():
        with nodes[port].client(timeout=5) as client:
            client.execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)


async def test_a_copys_slot_moved_by_a_reshard_is_found_again(
    clients: list[Client], redis_cluster: LocalRedisCluster, redis_cluster_url: str
) -> None:
    """Slot 0 (the first place of every copy) moves to another master: the writers find
    their masters' copies in the next place, so the holder writes and the stale writer,
    with an old slot map or a new one, writes nothing."""
    old, new = Indexer(clients[0], "old"), Indexer(clients[1], "new")
    lost = await old.take()
    await old.write(0)
    grant = await new.take()
    await clients[2].initialize()  # type: ignore[union-attr]
    home = clients[2].nodes_manager.get_node_from_slot(0).port  # type: ignore[union-attr]
    away = next(p for p in redis_cluster.master_ports() if p != home)
    _move_slot(redis_cluster, 0, home, away)
    fresh = [connect(redis_cluster_url) for _ in range(2)]
    try:
        before = snapshot(redis_cluster)
        moved = new.index.keys.fence_copy(0, POD).encode()
        assert moved in before[away]  # the copy went with its slot
        assert any(k.startswith(b"gkv:fc:") for k in before[home])  # the next places
        with pytest.raises((IndexFenced, IndexUnavailable)):  # its slot map is out of date
            await old.write(1)
        stale = Indexer(fresh[0], "old")
        stale.index.set_fence(POD, lost.fence)
        with pytest.raises(IndexFenced):
            await stale.write(1)
        assert snapshot(redis_cluster) == before

        holder = Indexer(fresh[1], "new")
        holder.index.set_fence(POD, grant.fence)
        await holder.write(1)
        (stats,) = await holder.index.stats(POD)
        assert stats.last_seq == 1
    finally:
        for client in fresh:
            await client.aclose()
        _move_slot(redis_cluster, 0, away, home)


async def test_a_holder_granted_below_the_copies_releases_and_is_granted_above_them(
    clients: list[Client],
) -> None:
    """The `{p}` master came back empty with a clock behind the last grant: the copies of
    that grant count above the next one. The new holder's first block call is fenced;
    its lease still its own, it releases it, and its next grant counts above the copies."""
    ahead = int(time.time() * 1000) + 60_000  # a grant "ahead" of the {p} master's clock
    index = RedisIndex(clients[0], BS, fenced=True)
    await index.copy_fence(POD, f"{ahead}:old/0")
    new = Indexer(clients[1], "new")
    grant = await new.take()
    assert int(grant.fence.token.partition(":")[0]) < ahead
    with pytest.raises(IndexFenced):
        await new.write(0)
    assert await new.leases.owners([POD]) == {}  # released
    new.index.set_fence(POD, None)  # Ownership.lost

    again = await new.take()
    assert int(again.fence.token.partition(":")[0]) > ahead
    await new.write(0)
    (stats,) = await new.index.stats(POD)
    assert stats.last_seq == 0


def _replicas_ack(cluster: LocalRedisCluster) -> bool:
    """Whether every master's replica acknowledges a write within a second."""
    for port in cluster.master_ports():
        node = next(n for n in cluster.nodes if n.port == port)
        with node.client(timeout=5) as client:
            ranges = [
                (r[0], r[1]) for r in client.execute_command("CLUSTER SLOTS") if r[2][1] == port
            ]
            probe = next(
                f"probe{i}"
                for i in count()
                if any(a <= key_slot(f"probe{i}".encode()) <= b for a, b in ranges)
            )
            client.set(probe, 1)
            if client.wait(1, 1000) < 1:
                return False
    return True


def _waits(cluster: LocalRedisCluster) -> dict[int, int]:
    """WAIT calls served so far, per master."""
    out = {}
    for port in cluster.master_ports():
        node = next(n for n in cluster.nodes if n.port == port)
        with node.client(timeout=5) as client:
            stats = client.info("commandstats")
            out[port] = int(stats.get("cmdstat_wait", {}).get("calls", 0))
    return out


async def test_a_taker_returns_once_every_masters_replica_holds_its_copies(
    clients: list[Client], redis_cluster: LocalRedisCluster
) -> None:
    """A replica promoted after the grant then holds the taker's copies, not the previous
    holder's, so the previous holder's block calls there are refused."""

    async def replicas_in_sync() -> bool:  # not yet while in their first sync
        return _replicas_ack(redis_cluster)

    await await_for(replicas_in_sync, timeout=30, what="every master's replica to be in sync")
    before = _waits(redis_cluster)
    grant = await Indexer(clients[0], "new").take()
    after = _waits(redis_cluster)
    assert all(after[port] > before[port] for port in before), (before, after)
    masters = set(redis_cluster.master_ports())
    replicas = [n for n in redis_cluster.nodes if n.port not in masters]
    assert replicas
    for node in replicas:
        with node.client(timeout=5) as client:
            client.execute_command("READONLY")
            copies = list(client.scan_iter(match=f"gkv:fc:*{POD}", count=1000))
            assert copies, f"replica {node.port} holds no copy"
            assert {client.get(key) for key in copies} == {grant.fence.token.encode()}


@pytest.mark.xfail(
    strict=True,
    reason="known hole (redis_fences docstring): a master promoted without the taker's "
    "copies holds the old token; the taker's WAIT makes this rare, not impossible",
)
async def test_a_master_promoted_without_the_takers_copies_refuses_the_old_writer(
    redis_cluster_url: str, redis_cluster: LocalRedisCluster
) -> None:
    """A replica promoted before it got the taker's barrier and copy (its master did not
    hear back within `COPY_WAIT_MS`) still holds the old holder's copy, and the old
    holder's block call there passes at once. (Its batch call is refused, so this is a
    half batch.) Closing it needs a check on `{p}` before the block calls: a round trip
    per batch."""
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
