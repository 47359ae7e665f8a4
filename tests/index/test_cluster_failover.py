"""The index on a Redis Cluster whose master dies: answers stay right or say unavailable,
and writes the failover lost are found and resynced."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from globalkv.index.base import Index, IndexDataLost, IndexUnavailable, Source, SourceBatch
from globalkv.index.memory import MemoryIndex
from globalkv.index.redis import RedisIndex
from globalkv.redis_client import Client, connect
from globalkv.stack.redis_cluster import LocalRedisCluster
from tests.index.events import BS, Feeder, depths, keys, remove, store, tokens

pytestmark = pytest.mark.integration

STABLE = [Source(f"stable{i}") for i in range(4)]
BUSY = Source("busy")
CHAIN = 6 * 16
"""Blocks per chain: six segments, spread over every master."""


@pytest.fixture
def cluster() -> Iterator[LocalRedisCluster]:
    """A cluster of its own: the test kills one of its masters."""
    own = LocalRedisCluster(masters=3, replicas=1, node_timeout_ms=1000)
    own.start()
    yield own
    own.stop()


@pytest.fixture
async def client(cluster: LocalRedisCluster) -> AsyncIterator[Client]:
    opened = connect(cluster.url, socket_timeout=2, socket_connect_timeout=1)
    yield opened
    await opened.aclose()


SHARED = tokens(CHAIN, start=100_000)
"""One chain every stable source holds a prefix of (source i: all but 10 i blocks)."""


async def _feed_stable(*indexes: Index) -> None:
    for index in indexes:
        feed = Feeder(index)
        for i, source in enumerate(STABLE):
            held = CHAIN - 10 * i
            await feed(source, store(range(1, held + 1), SHARED[: held * BS]))


def _busy_batches(count: int) -> list[SourceBatch]:
    """A source storing chains and evicting older ones, as a busy engine does."""
    batches = []
    for n in range(count):
        first = 1 + n * 40
        events = [store(range(first, first + 40), tokens(40, start=10_000_000 + n * 1000))]
        if n >= 3:
            old = 1 + (n - 3) * 40
            events.append(remove(range(old + 20, old + 40)))
        batches.append(SourceBatch(BUSY, n, 1.0, events))
    return batches


async def _apply_until_done(index: RedisIndex, batches: list[SourceBatch]) -> int:
    """Apply in order as ingest does: hold a batch while the index is unavailable, and
    on lost data replay the source from its first batch (after a reset). Returns the
    number of resyncs."""
    resyncs, n = 0, 0
    deadline = time.monotonic() + 60
    while n < len(batches):
        assert time.monotonic() < deadline, "the index did not come back"
        try:
            await index.apply(batches[n])
            n += 1
        except IndexDataLost:
            resyncs += 1
            await index.reset_source(BUSY)
            n = 0
        except IndexUnavailable:
            await asyncio.sleep(0.05)
    return resyncs


async def test_a_killed_master_gives_right_answers_or_unavailable_then_right_again(
    cluster: LocalRedisCluster, client: Client
) -> None:
    index, reference = RedisIndex(client, BS), MemoryIndex(BS)
    await _feed_stable(index, reference)
    for node in cluster.nodes:  # the stable data is on the replicas before the kill
        if node.port in cluster.master_ports():
            with node.client(timeout=5) as sync:
                sync.execute_command("WAIT", 1, 5000)
    chains = [keys(SHARED[: n * BS]) for n in (CHAIN, 70, 17)]
    expected = [depths(await reference.lookup(chain)) for chain in chains]
    assert expected[0] == {s: CHAIN - 10 * i for i, s in enumerate(STABLE)}

    reader = RedisIndex(client, BS)
    answered: list[tuple[float, float, bool]] = []  # start, end, answered (not unavailable)
    wrong: list[object] = []
    killed_at: list[float] = []

    def streak() -> int:
        """Answers in a row since the last unavailable, among lookups begun after the kill."""
        count = 0
        for start, _, ok in reversed(answered):
            if not ok or start < killed_at[0]:
                break
            count += 1
        return count

    async def lookups() -> None:
        while not killed_at or streak() < 50:
            if killed_at and time.monotonic() - killed_at[0] > 30:
                return
            for chain, want in zip(chains, expected, strict=True):
                start = time.monotonic()
                try:
                    got = depths(await reader.lookup(chain))
                except IndexUnavailable:
                    answered.append((start, time.monotonic(), False))
                    continue
                answered.append((start, time.monotonic(), True))
                if got != want:
                    wrong.append(got)
            await asyncio.sleep(0.01)

    async def kill_one() -> None:
        await asyncio.sleep(0.3)
        control = client.nodes_manager.get_node_from_slot(client.keyslot(index.keys.live))
        victim = next(p for p in cluster.master_ports() if p != control.port)
        killed_at.append(time.monotonic())
        cluster.kill(victim)

    batches = _busy_batches(60)
    busy = MemoryIndex(BS)
    for batch in batches:
        await busy.apply(batch)
    looking = asyncio.create_task(lookups())
    await kill_one()
    resyncs = await _apply_until_done(index, batches)
    await asyncio.wait_for(looking, 60)
    assert not wrong, f"wrong answers during the failover: {wrong[:3]}"
    assert streak() >= 50, "lookups were not answering again 30 s after the kill"
    # Right again: the end of the first answer after the last unavailable one, among
    # lookups begun after the kill (redis-py's retries may also hide the outage inside
    # one slow lookup, which then counts until it answers).
    back = answered[-streak()][1] - killed_at[0]
    unavailable = sum(1 for _, _, ok in answered if not ok)
    print(f"right again {back:.2f}s after the kill ({unavailable} unavailable, {resyncs} resyncs)")

    await asyncio.to_thread(cluster.wait_ok, 30)
    after = RedisIndex(client, BS)
    for chain, want in zip(chains, expected, strict=True):
        assert depths(await after.lookup(chain)) == want
    for n in range(60):
        chain = keys(tokens(40, start=10_000_000 + n * 1000))
        assert depths(await after.lookup(chain)) == depths(await busy.lookup(chain)), n


async def test_block_writes_a_failover_lost_are_found_and_their_source_hidden(
    redis_cluster_url: str,
) -> None:
    client = connect(redis_cluster_url)
    try:
        index = RedisIndex(client, BS)
        feed = Feeder(index)
        await _feed_stable(index)
        chain = keys(SHARED)
        assert depths(await index.lookup(chain))[STABLE[1]] == CHAIN - 10
        # What a promoted replica lacking the last writes looks like: counters behind.
        names = [n async for n in client.scan_iter(match=f"{index.keys.prefix}:ck:*")]
        assert names
        for name in names:
            await client.decr(name)
        index._checks.suspect = True  # as after any unavailable call
        with pytest.raises(IndexDataLost, match="failover lost block writes") as caught:
            await feed(STABLE[0], store([999], tokens(1, start=5_000_000)))
        assert caught.value.sources == frozenset(STABLE), "ingest resyncs these, no others"
        assert await index.lookup(chain) == [], "every source written there is hidden"
        await feed(STABLE[0], store([999], tokens(1, start=5_000_000)))  # writes go on
    finally:
        await client.aclose()
