"""The indexer on Redis: a Redis restart while ingesting, and pods written by others.

While Redis is down or the index is being rebuilt the API answers 503, never a lookup
against a half-empty index; once resynced (replay from seq 0) the pod's full prefix is
back, and so are the pods in the registry.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import httpx
import pytest
import zmq.asyncio

from globalkv import redis_client
from globalkv.index.base import Source
from globalkv.index.redis import RedisIndex
from globalkv.indexer import Indexer, IndexerConfig
from globalkv.ingest.config import IngestConfig
from globalkv.keys import BlockKey, request_keys
from globalkv.registry import KvEventsConfig, PodInfo, RedisRegistry
from tests.ingest.publisher_proc import PublisherProc, chain
from tests.support.net import await_for
from tests.support.redis import RedisServer

pytestmark = pytest.mark.integration

BS = 4
PROMPT = list(range(300, 340))


def block(n: int) -> dict[str, object]:
    return chain(
        PROMPT[n * BS : (n + 1) * BS], BS, first_hash=2000 + n, parent=None if n == 0 else 1999 + n
    )


async def _indexer(url: str) -> Indexer:
    redis = redis_client.connect(url)
    config = IndexerConfig(
        block_size=BS,
        reconcile_interval=0.2,
        ingest=IngestConfig(retry_base=0.02, retry_cap=0.2, replay_reply_timeout=2.0),
    )
    indexer = Indexer(
        config, index=RedisIndex(redis, BS), registry=RedisRegistry(redis), redis=redis
    )
    await indexer.start()
    return indexer


@pytest.fixture
async def own_redis() -> AsyncIterator[RedisServer]:
    server = RedisServer()
    yield server
    server.stop()


T = TypeVar("T")


async def bounded(step: Awaitable[T], what: str, timeout: float = 20.0) -> T:
    """Every step of these tests is bounded: a stuck one fails naming itself, instead of
    the whole test hanging until pytest's timeout with nothing to show where."""
    try:
        return await asyncio.wait_for(step, timeout)
    except TimeoutError:
        raise TimeoutError(f"{what} did not finish within {timeout:g}s") from None


async def lookup(client: httpx.AsyncClient) -> httpx.Response:
    body = {"model": "m", "token_ids": PROMPT}
    return await bounded(client.post("/v1/lookup", json=body), "a lookup")


def depth(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    pods = response.json()["pods"]
    return int(pods[0]["hit_blocks"]) if pods else 0


async def test_redis_restart_while_ingesting_answers_503_then_resyncs(
    own_redis: RedisServer, context: zmq.asyncio.Context
) -> None:
    indexer = await _indexer(own_redis.url)
    pub = await PublisherProc.start(context)
    transport = httpx.ASGITransport(app=indexer.app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://ix") as client:
            body = {
                "id": "p0",
                "model": "m",
                "kv_events": {"endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint},
            }
            assert (await client.post("/v1/pods", json=body)).status_code == 201
            await pub.call(op="wait_subscribed")
            for n in range(4):
                seq = await pub.publish(block(n))
            await indexer.ingest.followed.applied(Source("p0"), seq)
            assert depth(await lookup(client)) == 4

            await bounded(asyncio.to_thread(own_redis.restart), "the Redis restart", 30)
            await pub.call(op="hold_replay")
            seq = await pub.publish(block(4))

            async def resyncing() -> bool:
                return not indexer.ingest.recovery.ready

            await await_for(resyncing, timeout=20, what="the indexer to notice the lost data")
            during = await lookup(client)
            assert during.status_code == 503
            assert "resync" in during.json()["detail"]
            assert (await bounded(client.get("/health"), "/health")).status_code == 503

            await pub.call(op="release_replay")
            await indexer.ingest.followed.applied(Source("p0"), seq, timeout=20)
            await asyncio.wait_for(indexer.ingest.followed.flush(), 20)
            assert indexer.ingest.recovery.ready
            assert depth(await lookup(client)) == 5

            async def pod_restored() -> bool:
                return await bounded(indexer.registry.get("p0"), "a registry read") is not None

            await await_for(pod_restored, timeout=10, what="the registry to be written back")
            metrics = (await bounded(client.get("/metrics"), "/metrics")).text
            assert "globalkv_ingest_index_data_lost_total 1.0" in metrics
    finally:
        pub.stop()
        await bounded(indexer.stop(), "the indexer's stop")


async def test_pods_written_to_the_redis_registry_by_others_are_followed(
    redis_url: str, context: zmq.asyncio.Context
) -> None:
    indexer = await _indexer(redis_url)
    gateway_side = RedisRegistry(redis_client.connect(redis_url))
    pub = await PublisherProc.start(context)
    try:
        pod = PodInfo(
            id="g0",
            model="m",
            kv_events=KvEventsConfig(endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint),
        )
        await gateway_side.put(pod)

        async def followed() -> bool:
            return "g0" in {p.id for p in indexer.ingest.following.pods()}

        await await_for(followed, timeout=10, what="the indexer to follow g0")
        await pub.call(op="wait_subscribed")
        seq = await pub.publish(block(0), block(1))
        await indexer.ingest.followed.applied(Source("g0"), seq)
        assert [h.blocks for h in await indexer.index.lookup(_keys())] == [2]

        async def state_published() -> bool:
            states = await gateway_side.states()
            return "g0" in states and states["g0"].sources[0].last_seq == seq

        await await_for(state_published, timeout=10, what="g0's state in the registry")

        await gateway_side.remove("g0")

        async def dropped() -> bool:
            return not await followed() and await indexer.index.lookup(_keys()) == []

        await await_for(dropped, timeout=10, what="the indexer to drop g0 and its blocks")
    finally:
        pub.stop()
        await indexer.stop()
        await gateway_side.redis.aclose()


def _keys() -> list[BlockKey]:
    return request_keys(PROMPT, BS, "m")
