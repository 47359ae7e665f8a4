"""Gateway replicas sharing loads and pending prompts through a real Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from gateway.load.pending import PendingPrefixes
from gateway.load.tracker import LoadTracker
from gateway.policies.base import Choice
from gateway.replicas.shared_state import SharedState
from globalkv import redis_client
from kvplumbing.tasks import cancel_and_wait
from tests.support.metrics import sample
from tests.support.net import await_for
from tests.support.redis import RedisServer, write_torn


def _replica(
    client: redis_client.Client, name: str, registry: CollectorRegistry | None = None
) -> tuple[LoadTracker, SharedState]:
    tracker = LoadTracker(pending=PendingPrefixes(0.0))
    registry = registry or CollectorRegistry()
    shared = SharedState(client, tracker, member=name, interval=0.05, registry=registry, grace_s=0)
    tracker.shared = shared
    return tracker, shared


@pytest.fixture
async def own_redis() -> AsyncIterator[RedisServer]:
    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture(params=["redis", "cluster"])
def shared_url(request: pytest.FixtureRequest) -> str:
    """One Redis, or a Redis Cluster (loads on several masters, pub/sub across nodes)."""
    fixture = "redis_url" if request.param == "redis" else "redis_cluster_url"
    return str(request.getfixturevalue(fixture))


async def test_a_replica_sees_the_others_load_and_pending_prompts(shared_url: str) -> None:
    client = redis_client.connect(shared_url)
    a_loads, a = _replica(client, "gw-a")
    b_prom = CollectorRegistry()
    b_loads, b = _replica(client, "gw-b", b_prom)
    tasks = [asyncio.create_task(a.run()), asyncio.create_task(b.run())]
    try:
        async with asyncio.timeout(10):  # pub/sub drops what is sent before
            await a.listening.wait()
            await b.listening.wait()
        ticket = a_loads.start_prefill(Choice("p0", uncached_tokens=100), [11, 12])

        async def b_sees_it() -> bool:
            (seen,) = b_loads.candidates(["p0"])
            held = b_loads.pending_blocks([11, 12, 13]).get("p0")
            return seen.in_flight == 1 and seen.queued_prefill_tokens == 100 and held is not None

        await await_for(b_sees_it, timeout=10, what="b to see a's load and pending prompt")
        assert b_loads.pending_blocks([11, 12, 13])["p0"].blocks == 2
        (own,) = a_loads.candidates(["p0"])
        assert own.in_flight == 1  # its own only: a replica never counts itself twice
        assert sample(b_prom, "globalkv_gateway_shared_replicas") == 1

        a_loads.finish(ticket)

        async def b_sees_it_done() -> bool:
            (seen,) = b_loads.candidates(["p0"])
            return seen.in_flight == 0 and not b_loads.pending_blocks([11, 12, 13])

        await await_for(b_sees_it_done, timeout=10, what="b to see a's request done")
    finally:
        await cancel_and_wait(tasks)
        await client.aclose()


async def test_losing_redis_falls_back_to_the_replica_s_own_view(own_redis: RedisServer) -> None:
    client = aioredis.from_url(own_redis.url)
    a_loads, a = _replica(client, "gw-a")
    registry = CollectorRegistry()
    b_loads, b = _replica(client, "gw-b", registry)
    tasks = [asyncio.create_task(a.run()), asyncio.create_task(b.run())]
    try:
        a_loads.start_prefill(Choice("p0", uncached_tokens=100))
        b_loads.start_prefill(Choice("p0", uncached_tokens=7))

        async def shared() -> bool:
            return b_loads.candidates(["p0"])[0].queued_prefill_tokens == 107

        await await_for(shared, timeout=10, what="b to add a's load")
        assert sample(registry, "globalkv_gateway_shared_state_available") == 1
        own_redis.stop()

        async def alone() -> bool:
            return b_loads.candidates(["p0"])[0].queued_prefill_tokens == 7

        await await_for(alone, timeout=10, what="b to fall back to its own view")
        assert sample(registry, "globalkv_gateway_shared_state_available") == 0
        assert sample(registry, "globalkv_gateway_shared_state_failures_total") >= 1
    finally:
        await cancel_and_wait(tasks)
        await client.aclose()


async def test_a_connection_closed_under_a_write_falls_back_instead_of_ending_the_loop(
    redis_url: str,
) -> None:
    """redis-py's AttributeError for a transport closed under a write would have ended the
    sharing loop and left the others' last loads in place for good."""
    client = aioredis.Redis.from_url(redis_url, single_connection_client=True)
    registry = CollectorRegistry()
    _, shared = _replica(client, "gw-a", registry)
    await shared.step()  # the one connection is open
    assert sample(registry, "globalkv_gateway_shared_state_available") == 1
    async with write_torn(client):
        task = asyncio.create_task(shared.run())
        try:

            async def fell_back() -> bool:
                return sample(registry, "globalkv_gateway_shared_state_failures_total") >= 1

            await await_for(fell_back, timeout=10, what="the round to fail")
            assert not task.done(), "the sharing loop ended"
            assert sample(registry, "globalkv_gateway_shared_state_available") == 0
        finally:
            await cancel_and_wait([task])
