"""A full Redis (`maxmemory` with `noeviction`, as `docs/operations.md` requires) refuses
the apply script: the batch is held and retried like an outage, not dropped, and `/health`
says the index is degraded and why until Redis takes writes again."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import redis
import zmq.asyncio
from prometheus_client import CollectorRegistry

from globalkv import redis_client
from globalkv.api import ApiConfig, create_app
from globalkv.index.base import Source
from globalkv.index.redis import RedisIndex
from globalkv.ingest.config import IngestConfig
from globalkv.ingest.service import IngestService
from globalkv.keys import request_keys
from globalkv.metrics import IngestMetrics
from globalkv.registry import MemoryRegistry
from tests.ingest.conftest import PublisherFactory
from tests.ingest.test_service import follow, pod_for, store
from tests.support.metrics import sample
from tests.support.redis import RedisServer

P0 = Source("p0", 0)
KEYS = request_keys([0, 0, 0, 0, 1, 1, 1, 1], 4, "m")
"""The blocks `store(0)` and `store(1)` store."""


@pytest.fixture
def small_redis() -> Iterator[RedisServer]:
    server = RedisServer(args=("--maxmemory", "4mb", "--maxmemory-policy", "noeviction"))
    yield server
    server.stop()


def _fill(port: int) -> None:
    """Write filler until Redis refuses a write, then keep it over its limit: the refused
    command's buffer is freed, and Redis would otherwise dip just under it again."""
    with redis.Redis(port=port) as client:
        for n in range(1000):
            try:
                client.set(f"filler:{n}", b"x" * 65536)
            except redis.exceptions.OutOfMemoryError:
                break
        else:
            raise AssertionError("redis never became full")
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory", str(used - 65536))


async def test_a_full_redis_holds_the_batch_and_health_says_degraded(
    small_redis: RedisServer, context: zmq.asyncio.Context, make_publisher: PublisherFactory
) -> None:
    client = redis_client.connect(small_redis.url)
    index = RedisIndex(client, 4)
    prom = CollectorRegistry()
    config = IngestConfig(retry_base=0.01, retry_cap=0.05)
    service = IngestService(index, MemoryRegistry(), IngestMetrics(prom), config, context=context)
    app = create_app(
        ApiConfig(), index=index, registry=service.registry, ingest=service, metrics_registry=prom
    )
    transport = httpx.ASGITransport(app=app)
    pub = await make_publisher()
    try:
        await follow(service, pub, pod_for(pub))
        await pub.send([store(0)])
        await service.followed.applied(P0, 0)
        _fill(small_redis.port)
        await pub.send([store(1)])
        await service.followed.wait(P0, lambda _: P0 in service.recovery.held)
        async with httpx.AsyncClient(transport=transport, base_url="http://indexer") as http:
            health = (await http.get("/health")).json()
            assert health["status"] == "degraded"
            assert health["held_sources"] == 1
            assert "maxmemory" in health["reason"]
            assert sample(prom, "globalkv_ingest_held_sources") == 1
            assert sample(prom, "globalkv_ingest_dropped_total", reason="internal_error") == 0
            assert [hit.blocks for hit in await index.lookup(KEYS)] == [1], "held, not applied"
            with redis.Redis(port=small_redis.port) as direct:
                direct.config_set("maxmemory", "0")  # the operator gives Redis room
            await service.followed.applied(P0, 1)
            health = (await http.get("/health")).json()
        assert (health["status"], health["held_sources"], health["reason"]) == ("ok", 0, None)
        assert [hit.blocks for hit in await index.lookup(KEYS)] == [2], "applied, not dropped"
    finally:
        await service.stop()
        await index.close()
        await client.aclose()
