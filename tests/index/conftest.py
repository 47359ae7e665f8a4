"""The backends every shared index test runs against: memory, fakeredis, a real Redis and
a real Redis Cluster (3 masters, 3 replicas)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import fakeredis
import pytest
import redis.asyncio as aioredis

from globalkv.index.base import Index
from globalkv.index.memory import MemoryIndex
from globalkv.index.redis import RedisIndex
from globalkv.redis_client import Client, connect

BACKENDS = ["memory", "fakeredis", "redis", "cluster"]


class Backend:
    """Builds indexes of one kind; `restart` gives a new writer on the same data."""

    def __init__(self, name: str, client: Client | None = None) -> None:
        self.name = name
        self.client = client
        self._kwargs: dict[str, Any] = {}
        self._memory: MemoryIndex | None = None

    @property
    def is_redis(self) -> bool:
        return self.client is not None

    def make(self, block_size: int = 4, **kwargs: Any) -> Index:
        self._kwargs = {"block_size": block_size, **kwargs}
        if self.client is None:
            self._memory = MemoryIndex(block_size, **kwargs)
            return self._memory
        return RedisIndex(self.client, block_size, **kwargs)

    def restart(self) -> Index:
        """A fresh writer process on the same data (memory has no such thing: the same)."""
        if self.client is None:
            assert self._memory is not None
            return self._memory
        kwargs = dict(self._kwargs)
        return RedisIndex(self.client, kwargs.pop("block_size"), **kwargs)


@pytest.fixture(params=BACKENDS)
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    if request.param == "memory":
        yield Backend("memory")
        return
    client: Client
    if request.param == "fakeredis":
        client = fakeredis.FakeAsyncRedis()
    elif request.param == "cluster":
        client = connect(request.getfixturevalue("redis_cluster_url"))
    else:
        client = aioredis.from_url(request.getfixturevalue("redis_url"))
    yield Backend(request.param, client)
    await client.aclose()
