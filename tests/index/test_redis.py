"""What only the Redis backend promises: restarts, data loss, outages, layout."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Awaitable, Callable

import fakeredis
import pytest
import redis.asyncio as aioredis
from redis.cluster import key_slot

from globalkv.index.base import ApplyResult, IndexDataLost, IndexUnavailable, Source, Tier
from globalkv.index.redis import RedisIndex
from globalkv.index.redis_keys import HEAD_SEGMENTS, SEGMENT, SLOTS, TAIL_SEGMENT
from globalkv.index.redis_scripts import fingerprints, replay_log
from tests.index.events import (
    BS,
    P0,
    P0_DP1,
    P1,
    Feeder,
    depths,
    keys,
    remove,
    scores,
    store,
    tokens,
)
from tests.support.redis import RedisServer


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
async def own_server() -> AsyncIterator[RedisServer]:
    """A server this test may stop and restart."""
    server = RedisServer()
    yield server
    server.stop()


async def _past_dead_connections(call: Callable[[], Awaitable[ApplyResult]]) -> ApplyResult:
    """The pool's connections died with the server: the first call may only say so."""
    for _ in range(3):
        try:
            return await call()
        except IndexDataLost:
            raise
        except IndexUnavailable:
            continue
    raise AssertionError("redis stayed unavailable")


async def test_a_restarted_writer_rebuilds_its_sources_from_redis(
    client: aioredis.Redis,
) -> None:
    t = tokens(4)
    first = Feeder(RedisIndex(client, BS))
    await first(P0, store([1, 2], t[: 2 * BS]), store([2], t[BS : 2 * BS], tier=Tier.CPU))
    await first(P0, store([9], t[:BS]))  # an alias of block 1
    restarted = RedisIndex(client, BS)
    feed = Feeder(restarted)
    assert await feed(P0, store([3, 4], t[2 * BS :], parent=2)) == ApplyResult(stored=2)
    assert depths(await restarted.lookup(keys(t))) == {P0: 4}
    await feed(P0, remove([1]), remove([2], Tier.GPU))
    hits = await restarted.lookup(keys(t))
    assert depths(hits) == {P0: 4}
    assert hits[0].score == pytest.approx(3.8)
    (stats,) = await restarted.stats()
    assert stats.blocks == {Tier.GPU: 3, Tier.CPU: 1, Tier.DISK: 0}
    assert stats.resets == 0


async def test_the_reverse_log_is_compacted_and_still_rebuilds(client: aioredis.Redis) -> None:
    index = RedisIndex(client, BS)
    feed = Feeder(index)
    t = tokens(3)
    await feed(P0, store([1], t[:BS]))
    for _ in range(700):  # churn: two records per batch, nothing more held
        await feed(P0, store([2, 3], t[BS:], parent=1), remove([2, 3]))
    await feed(P0, store([2], t[BS : 2 * BS], parent=1, tier=Tier.CPU))
    (stats,) = await index.stats()
    logged = list(replay_log(await client.lrange(index.keys.log(stats.epoch), 0, -1)))
    assert len(logged) <= 2 * 2 + 1024 + 2  # twice the blocks held, plus the slack
    restarted = RedisIndex(client, BS)
    assert await Feeder(restarted)(P0, store([3], t[2 * BS :], parent=2)) == ApplyResult(stored=1)
    hits = await restarted.lookup(keys(t))
    assert depths(hits) == {P0: 3}
    assert hits[0].score == pytest.approx(2.8)


async def test_a_gateway_reader_sees_writes_and_resets_at_once(client: aioredis.Redis) -> None:
    writer = RedisIndex(client, BS)
    reader = RedisIndex(client, BS)
    feed = Feeder(writer)
    t = tokens(2)
    await feed(P0, store([1, 2], t))
    await feed(P1, store([1], t[:BS]))
    assert depths(await reader.lookup(keys(t))) == {P0: 2, P1: 1}
    await writer.reset_source(P0)
    assert depths(await reader.lookup(keys(t))) == {P1: 1}


async def test_flushed_redis_raises_data_lost_once_then_starts_fresh(
    client: aioredis.Redis,
) -> None:
    index = RedisIndex(client, BS)
    feed = Feeder(index)
    t = tokens(2)
    await feed(P0, store([1], t[:BS]))
    await feed(P1, store([1], t[:BS]))
    await client.flushall()
    with pytest.raises(IndexDataLost):
        await feed(P0, store([2], t[BS:], parent=1))
    assert await feed(P1, store([5], t[:BS])) == ApplyResult(stored=1)
    assert await feed(P0, store([1, 2], t)) == ApplyResult(stored=2)
    assert depths(await index.lookup(keys(t))) == {P0: 2, P1: 1}


async def test_a_restarted_empty_redis_raises_data_lost(own_server: RedisServer) -> None:
    client = aioredis.from_url(own_server.url)
    try:
        index = RedisIndex(client, BS)
        feed = Feeder(index)
        await feed(P0, store([1], tokens(1)))
        own_server.restart()
        with pytest.raises(IndexDataLost):
            await _past_dead_connections(
                lambda: feed(P0, store([2], tokens(1, start=BS), parent=1))
            )
        assert await index.lookup(keys(tokens(1))) == []
        assert await feed(P0, store([1], tokens(1))) == ApplyResult(stored=1)
    finally:
        await client.aclose()


async def test_a_source_rewritten_elsewhere_raises_data_lost(client: aioredis.Redis) -> None:
    """Another writer for the same source (or lost writes) is caught by the batch count."""
    index = RedisIndex(client, BS)
    feed = Feeder(index)
    await feed(P0, store([1], tokens(1)))
    await Feeder(RedisIndex(client, BS))(P0, store([7], tokens(1, start=40)))
    with pytest.raises(IndexDataLost):
        await feed(P0, store([2], tokens(1, start=BS), parent=1))
    assert await feed(P0, store([2], tokens(1, start=BS), parent=1)) == ApplyResult(stored=1)


async def test_redis_down_raises_unavailable_everywhere(own_server: RedisServer) -> None:
    client = aioredis.from_url(own_server.url, socket_timeout=2)
    try:
        index = RedisIndex(client, BS)
        await Feeder(index)(P0, store([1], tokens(1)))
        own_server.stop()
        with pytest.raises(IndexUnavailable):
            await index.lookup(keys(tokens(1)))
        with pytest.raises(IndexUnavailable):
            await Feeder(index)(P0, store([2], tokens(1, start=BS), parent=1))
        with pytest.raises(IndexUnavailable):
            await index.stats()
        with pytest.raises(IndexUnavailable):
            await index.reset_source(P0)
        with pytest.raises(IndexUnavailable):
            await index.remove_pod("p0")
    finally:
        await client.aclose()


async def test_fakeredis_disconnected_raises_unavailable() -> None:
    server = fakeredis.FakeServer()
    client = fakeredis.FakeAsyncRedis(server=server)
    index = RedisIndex(client, BS)
    await Feeder(index)(P0, store([1], tokens(1)))
    server.connected = False
    with pytest.raises(IndexUnavailable):
        await index.lookup(keys(tokens(1)))
    with pytest.raises(IndexUnavailable):
        await Feeder(index)(P0, store([2], tokens(1, start=BS), parent=1))
    server.connected = True
    assert depths(await index.lookup(keys(tokens(1)))) == {P0: 1}
    await client.aclose()


async def test_a_chain_is_spread_over_slots_one_segment_each(client: aioredis.Redis) -> None:
    """A cluster walks a segment with one script, and consecutive segments sit far apart
    on the slot ring (on other masters), so a prefix every prompt shares is no hot slot."""
    index = RedisIndex(client, BS)
    blocks = HEAD_SEGMENTS * SEGMENT + TAIL_SEGMENT + 3
    t = tokens(blocks)
    await Feeder(index)(P0, store(range(1, blocks + 1), t))
    names = {n.decode() for n in await client.keys(f"{index.keys.block_prefix}*")}
    segments = index.keys.segments(keys(t))
    assert [s.length for s in segments] == [SEGMENT] * HEAD_SEGMENTS + [TAIL_SEGMENT, 3]
    named = {s.head + s.digits[i : i + 16] for s in segments for i in range(0, len(s.digits), 16)}
    assert named == names
    for segment in segments:
        assert {key_slot((segment.head + segment.digits[i : i + 16]).encode()) for i in
                range(0, len(segment.digits), 16)} == {segment.slot}  # fmt: skip
    slots = [s.slot for s in segments]
    gaps = [min((b - a) % SLOTS, (a - b) % SLOTS) for a, b in itertools.pairwise(slots)]
    assert min(gaps) > SLOTS // 4


async def test_resets_and_removals_drop_everything_without_scanning_the_keyspace(
    client: aioredis.Redis,
) -> None:
    index = RedisIndex(client, BS)
    feed = Feeder(index)
    t = tokens(40)
    await client.config_resetstat()
    for source in (P0, P0_DP1, P1):
        await feed(source, store(range(1, 41), t), store([5], t[4 * BS : 5 * BS], tier=Tier.CPU))
    await index.reset_source(P1)
    await index.remove_pod("p0")
    await feed(P1, store([1], t[:BS]))
    await index.remove_pod("p1")
    stats = await client.info("commandstats")
    assert not {"cmdstat_scan", "cmdstat_keys"} & set(stats)
    left = {k.decode() for k in await client.keys("*")}
    assert left == {index.keys.marker, index.keys.next_gen, index.keys.layout}


async def test_fingerprints_match_the_holders_of_every_block(client: aioredis.Redis) -> None:
    index = RedisIndex(client, BS)
    feed = Feeder(index)
    t = tokens(6)
    await feed(P0, store(range(1, 7), t), store([3], t[2 * BS : 3 * BS], tier=Tier.DISK))
    await feed(P1, store(range(1, 5), t[: 4 * BS], tier=Tier.CPU), remove([2], Tier.CPU))
    await feed(P0_DP1, store([1, 2], t[: 2 * BS]))
    await index.reset_source(P0_DP1)
    for name in await client.keys(f"{index.keys.block_prefix}*"):
        fields = await client.hgetall(name)
        holders = {int(g): int(v) for g, v in fields.items() if g != b"#"}
        assert all(fingerprints(g)[v % 8] == v for g, v in holders.items())
        assert int(fields[b"#"]) == sum(holders.values())


async def test_scripts_are_reloaded_after_redis_forgot_them(client: aioredis.Redis) -> None:
    index = RedisIndex(client, BS)
    feed = Feeder(index)
    await feed(P0, store([1], tokens(1)))
    await client.script_flush()
    assert await feed(P0, store([2], tokens(1, start=BS), parent=1)) == ApplyResult(stored=1)
    await client.script_flush()
    assert depths(await index.lookup(keys(tokens(2)))) == {P0: 2}


async def test_configuration_is_checked() -> None:
    decoding = aioredis.Redis(decode_responses=True)
    with pytest.raises(ValueError, match="decode_responses"):
        RedisIndex(decoding, BS)
    plain = aioredis.Redis()
    with pytest.raises(ValueError, match="prefix"):
        RedisIndex(plain, BS, prefix="a{b}")
    with pytest.raises(ValueError, match="block_size"):
        RedisIndex(plain, 0)
    with pytest.raises(ValueError, match="weight"):
        RedisIndex(plain, BS, tier_weights={Tier.GPU: -1.0})
    await decoding.aclose()
    await plain.aclose()


async def test_runs_ending_one_by_one_cost_no_reads_of_the_holders(
    client: aioredis.Redis,
) -> None:
    """The lookup script reads a block's holders only where "#" cannot tell what changed."""
    index = RedisIndex(client, BS)
    feed = Feeder(index)
    t = tokens(40)
    sources = [Source(f"p{i}") for i in range(20)]
    for i, source in enumerate(sources):
        await feed(source, store(range(1, 2 * i + 3), t[: (2 * i + 2) * BS]))
    chain = keys(t)
    assert depths(await index.lookup(chain)) == {s: 2 * i + 2 for i, s in enumerate(sources)}
    await client.config_resetstat()
    await index.lookup(chain)
    calls = {k: v["calls"] for k, v in (await client.info("commandstats")).items()}
    # One Redis walks the chain's segments as one stretch: the first block, and the live
    # generations.
    assert calls["cmdstat_hgetall"] == 2
    assert calls["cmdstat_hexists"] == 19  # one per run that ends before the chain does
    # Two runs ending at one block: read there. A running holder whose tier changes for
    # one block: read where it changes, and where it changes back.
    twin = Source("twin")
    await feed(twin, store(range(1, 7), t[: 6 * BS]))
    await feed(sources[19], store([20], t[19 * BS : 20 * BS], tier=Tier.CPU))
    await client.config_resetstat()
    hits = await index.lookup(chain)
    assert depths(hits)[twin] == depths(hits)[sources[2]] == 6
    assert scores(hits)[sources[19]] == 40.0
    calls = {k: v["calls"] for k, v in (await client.info("commandstats")).items()}
    assert calls["cmdstat_hgetall"] == 2 + 1 + 2
