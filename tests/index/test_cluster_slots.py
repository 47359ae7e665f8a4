"""The index on a Redis Cluster whose slots move (a reshard): lookups and writes follow
the move, and while a slot migrates a lookup answers right, shorter or unavailable."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import NamedTuple

import pytest
from redis import exceptions as redis_errors
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from globalkv.index import redis_failures, redis_shards
from globalkv.index.base import Index, IndexUnavailable, Source
from globalkv.index.memory import MemoryIndex
from globalkv.index.redis import RedisIndex
from globalkv.index.redis_keys import Segment
from globalkv.index.redis_shards import Shards, SlotMoved
from globalkv.keys import BlockKey
from globalkv.redis_client import Client, connect
from globalkv.stack.redis_cluster import LocalRedisCluster
from tests.index.events import BS, Feeder, depths, keys, store, tokens
from tests.support.redis_cluster import SlotMove

pytestmark = pytest.mark.integration

SOURCES = [Source(f"s{i}") for i in range(4)]
CHAIN = 6 * 16
"""Blocks per chain: six segments, so some master holds two of them."""
SHARED = tokens(CHAIN, start=100_000)
CHAINS = [keys(SHARED[: n * BS]) for n in (CHAIN, 70, 40, 17, 12)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalRedisCluster]:
    """A cluster of this module's own: its slots end up elsewhere than they started."""
    own = LocalRedisCluster(masters=3, replicas=0)
    own.start()
    yield own
    own.stop()


@pytest.fixture
async def client(cluster: LocalRedisCluster) -> AsyncIterator[Client]:
    for port in cluster.master_ports():
        with next(n for n in cluster.nodes if n.port == port).client(5) as sync:
            sync.flushall()
    opened = connect(cluster.url, socket_timeout=2, socket_connect_timeout=1)
    yield opened
    await opened.aclose()


async def _feed(*indexes: Index) -> None:
    """Source i holds all but the last 10 i blocks of the shared chain."""
    for index in indexes:
        feed = Feeder(index)
        for i, source in enumerate(SOURCES):
            held = CHAIN - 10 * i
            await feed(source, store(range(1, held + 1), SHARED[: held * BS]))


def _owner(client: Client, slot: int) -> int:
    """The port of the master serving `slot`, by the client's slot map."""
    assert isinstance(client, RedisCluster)
    return int(client.nodes_manager.get_node_from_slot(slot).port)


def _shared_slot(client: Client, index: RedisIndex) -> tuple[int, int]:
    """A slot of the shared chain whose master serves an earlier segment of it too (so
    its lookup script reads keys of two slots), and that master's port."""
    seen: set[int] = set()
    for segment in index.keys.segments(CHAINS[0]):
        port = _owner(client, segment.slot)
        if port in seen:
            return segment.slot, port
        seen.add(port)
    raise AssertionError("six segments on three masters: one master serves two")


def _other_master(cluster: LocalRedisCluster, port: int) -> int:
    return next(p for p in cluster.master_ports() if p != port)


async def test_a_moved_slot_is_followed_by_writes_and_lookups_at_once(
    cluster: LocalRedisCluster, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_shards, "REFRESH_INTERVAL", 0.0)  # two moves in a row
    writer, reader, reference = RedisIndex(client, BS), RedisIndex(client, BS), MemoryIndex(BS)
    await _feed(writer, reference)
    expected = [depths(await reference.lookup(chain)) for chain in CHAINS]
    assert [depths(await reader.lookup(c)) for c in CHAINS] == expected

    slot, port = _shared_slot(client, writer)
    await asyncio.to_thread(_move, cluster, slot, port)
    # The writer meets the move first: its batch is refused once, its retry regrouped.
    late = Source("late")
    batch = store(range(1, CHAIN + 1), SHARED)
    late_feed = Feeder(writer)
    for feed in (late_feed, Feeder(reference)):
        try:
            await feed(late, batch)
        except SlotMoved:
            await feed(late, batch)
    assert _owner(client, slot) != port, "the writer's refresh learnt the new owner"
    expected = [depths(await reference.lookup(chain)) for chain in CHAINS]
    assert expected[0][late] == CHAIN
    assert [depths(await reader.lookup(c)) for c in CHAINS] == expected

    # The reader meets the next move first: answered at once (one regrouped attempt).
    slot, port = _shared_slot(client, writer)
    await asyncio.to_thread(_move, cluster, slot, port)
    assert [depths(await reader.lookup(c)) for c in CHAINS] == expected
    assert _owner(client, slot) != port
    await late_feed(late, store([CHAIN + 1], tokens(1, start=7_000_000), parent=CHAIN))


def _move(cluster: LocalRedisCluster, slot: int, port: int) -> None:
    move = SlotMove(cluster, slot, port, _other_master(cluster, port))
    move.begin()
    move.finish()


async def test_lookups_while_a_slot_migrates_are_right_shorter_or_unavailable(
    cluster: LocalRedisCluster, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keys of a migrating slot are on the old master until moved, then on the new one;
    a walk meeting a moved key on the old master is refused (unavailable), and a walk the
    client sent to the new master (its first key moved: ASK) sees the keys not moved yet
    as missing, so its run ends early: shorter, never longer, never another pod. (Whether
    the ASK is followed depends on redis-py's connection pool: see docs/redis-cluster.md.)"""
    # Every refusal refreshes, so the first lookup after the move is right (with the
    # interval, the first one after it has passed).
    monkeypatch.setattr(redis_shards, "REFRESH_INTERVAL", 0.0)
    index, reference = RedisIndex(client, BS), MemoryIndex(BS)
    await _feed(index, reference)
    await client.ping()
    alone = _alone(client, index)
    for feed in (Feeder(index), Feeder(reference)):
        await feed(Source("alone"), store(range(1, 13), alone.tokens))
    chains = [*CHAINS, alone.chain]
    expected = [depths(await reference.lookup(chain)) for chain in chains]
    seen = {"right": 0, "shorter": 0, "unavailable": 0}

    async def look() -> None:
        for chain, want in zip(chains, expected, strict=True):
            try:
                got = depths(await index.lookup(chain))
            except IndexUnavailable:
                seen["unavailable"] += 1
                continue
            assert set(got) <= set(want), f"sources nobody stored: {got}"
            assert all(got[s] <= want[s] for s in got), f"deeper than stored: {got}"
            seen["right" if got == want else "shorter"] += 1

    segments = index.keys.segments(CHAINS[0])
    moves = [(segments[1], b""), (segments[0], b""), (alone.segment, alone.root)]
    for segment, first in moves:  # a later segment, the chain's root, a chain alone
        port = _owner(client, segment.slot)
        move = SlotMove(cluster, segment.slot, port, _other_master(cluster, port))
        await asyncio.to_thread(move.begin)
        await look()
        while moving := await asyncio.to_thread(move.keys):
            moving.sort(key=lambda name: name != first)
            await asyncio.to_thread(move.migrate, moving[:3])
            await look()
        await asyncio.to_thread(move.finish)
        assert [depths(await index.lookup(c)) for c in chains] == expected
    print(f"lookups during the migrations: {seen}")
    assert seen["unavailable"], "no lookup met a migrating key"


class _Alone(NamedTuple):
    tokens: list[int]
    chain: list[BlockKey]
    segment: Segment
    root: bytes


def _alone(client: Client, index: RedisIndex) -> _Alone:
    """A one-segment chain on a master without the live generations: a lookup's walk of
    it is one script reading only that slot, which ASK sends to the importing master."""
    home = _owner(client, key_slot(index.keys.live.encode()))
    for start in range(0, 100_000_000, 1_000_000):
        held = tokens(12, start=start)
        chain = keys(held)
        [segment] = index.keys.segments(chain)
        if _owner(client, segment.slot) != home:
            root = (segment.head + segment.digits[:16]).encode()
            return _Alone(held, chain, segment, root)
    raise AssertionError("every chain tried is on the master of the live generations")


async def test_scripts_a_master_lacks_are_loaded_again(
    cluster: LocalRedisCluster, client: Client
) -> None:
    """A promoted replica has no scripts (Redis 7 does not replicate SCRIPT LOAD)."""
    index, reference = RedisIndex(client, BS), MemoryIndex(BS)
    await _feed(index, reference)
    for port in cluster.master_ports():
        with next(n for n in cluster.nodes if n.port == port).client(5) as sync:
            sync.script_flush()
    assert depths(await index.lookup(CHAINS[0])) == depths(await reference.lookup(CHAINS[0]))


async def test_refusals_refresh_the_slot_map_once_per_interval(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_shards, "REFRESH_INTERVAL", 3600.0)
    await client.ping()  # as before any refusal: the client knows its cluster
    shards = Shards(client)
    refreshes: list[None] = []
    manager = type(client.nodes_manager)  # type: ignore[union-attr]
    initialize = manager.initialize

    async def counted(self: object) -> None:
        refreshes.append(None)
        await initialize(self)  # type: ignore[arg-type]

    monkeypatch.setattr(manager, "initialize", counted)

    async def refused() -> None:
        await asyncio.sleep(0)
        raise redis_errors.ResponseError(f"{redis_failures.NON_LOCAL} in a cluster node script")

    async def one_grouping() -> SlotMoved:
        with pytest.raises(SlotMoved) as caught:
            await shards.gather(refused(), refused())
        return caught.value

    first = await asyncio.gather(*(one_grouping() for _ in range(5)))
    assert len(refreshes) == 1
    assert all(e.regroup for e in first), "the concurrent groupings may all regroup"
    again = await one_grouping()
    assert len(refreshes) == 1, "too soon for another refresh"
    assert not again.regroup
    with pytest.raises(redis_errors.ResponseError, match="WRONGTYPE"):
        await shards.gather(_fails("WRONGTYPE Operation against a key"))


async def _fails(message: str) -> BlockKey:
    raise redis_errors.ResponseError(message)
