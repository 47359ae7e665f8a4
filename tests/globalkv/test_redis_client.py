"""After a Redis restart, the first command on each pooled connection is answered."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
import redis.asyncio as aioredis

from globalkv import redis_client
from tests.support.redis import RedisServer

pytestmark = pytest.mark.integration


@pytest.fixture
async def own_redis() -> AsyncIterator[RedisServer]:
    server = RedisServer()
    yield server
    server.stop()


async def _failures_after_a_restart(
    server: RedisServer, connect: Callable[[str], aioredis.Redis]
) -> int:
    client = connect(server.url)
    try:
        await asyncio.gather(*(client.ping() for _ in range(4)))  # four pooled connections
        await asyncio.to_thread(server.restart)
        failures = 0
        for _ in range(4):
            pipe = client.pipeline(transaction=False)
            pipe.get("a")
            pipe.hgetall("b")
            try:
                await pipe.execute()
            except aioredis.ConnectionError:
                failures += 1
        return failures
    finally:
        await client.aclose()


async def test_every_pooled_connection_answers_its_first_command_after_a_restart(
    own_redis: RedisServer,
) -> None:
    assert await _failures_after_a_restart(own_redis, redis_client.connect) == 0


async def test_a_plain_from_url_client_fails_there_which_is_why_connect_exists(
    own_redis: RedisServer,
) -> None:
    """redis-py's behaviour that `connect` corrects; if this starts passing with 0, redis-py
    gave `from_url` clients a retry and `connect` can go."""
    assert await _failures_after_a_restart(own_redis, aioredis.from_url) >= 1
