"""The Redis index's layout version: processes of different versions refuse each other's data."""

from __future__ import annotations

from collections.abc import AsyncIterator

import fakeredis
import pytest
import redis.asyncio as aioredis

from globalkv.index.base import IndexUnavailable
from globalkv.index.redis import RedisIndex
from globalkv.index.redis_keys import LAYOUT, LayoutMismatch, RedisKeys
from tests.index.events import BS, P0, Feeder, depths, keys, store, tokens


@pytest.fixture
async def client() -> AsyncIterator[aioredis.Redis]:
    client = fakeredis.FakeAsyncRedis()
    yield client
    await client.aclose()


async def test_the_first_writer_claims_the_prefix_and_readers_agree(
    client: aioredis.Redis,
) -> None:
    t = tokens(2)
    await Feeder(RedisIndex(client, BS))(P0, store([1, 2], t))
    assert await client.get(RedisKeys().layout) == LAYOUT
    assert depths(await RedisIndex(client, BS).lookup(keys(t))) == {P0: 2}


async def test_a_reader_on_an_empty_prefix_claims_it_too(client: aioredis.Redis) -> None:
    assert await RedisIndex(client, BS).lookup(keys(tokens(1))) == []
    assert await client.get(RedisKeys().layout) == LAYOUT


async def test_another_layout_is_refused_by_readers_and_writers(client: aioredis.Redis) -> None:
    await client.set(RedisKeys().layout, b"4")
    index = RedisIndex(client, BS)
    with pytest.raises(LayoutMismatch, match="holds an index of layout 4") as info:
        await index.lookup(keys(tokens(1)))
    assert isinstance(info.value, IndexUnavailable), "a gateway routes by load meanwhile"
    with pytest.raises(LayoutMismatch):
        await Feeder(index)(P0, store([1], tokens(1)))
    with pytest.raises(LayoutMismatch):
        await index.lookup(keys(tokens(1)))
    assert await client.get(RedisKeys().layout) == b"4"


async def test_prefixes_have_their_own_layout(client: aioredis.Redis) -> None:
    await client.set(RedisKeys("old").layout, b"1")
    await Feeder(RedisIndex(client, BS, prefix="new"))(P0, store([1], tokens(1)))
    assert await client.get(RedisKeys("new").layout) == LAYOUT
