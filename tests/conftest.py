from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq.asyncio

from tests.support.redis import RedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One real redis-server for the session; tests flush it through `redis_url`."""
    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    import redis

    with redis.Redis(port=redis_server.port) as client:
        client.flushall()
    return redis_server.url


@pytest.fixture
def context() -> Iterator[zmq.asyncio.Context]:
    """A ZMQ context per test, destroyed without lingering on unsent messages."""
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)
