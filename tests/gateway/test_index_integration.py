"""The gateway's policies and CLI wiring against the real index backends and registry."""

from __future__ import annotations

from contextlib import AsyncExitStack
from random import Random

import httpx
import redis.asyncio as aioredis

from gateway.load.tracker import LoadTracker
from gateway.policies import Choice, build_policy
from gateway.requests.query import RouteQuery
from gateway.serving.launch import _index_parts
from globalkv.index.base import Source, SourceBatch, StoreBlocks, Tier
from globalkv.index.memory import MemoryIndex
from globalkv.keys import EngineHash, root_key
from globalkv.lookup import IndexLookup
from globalkv.registry import RedisRegistry
from tests.gateway.fakes import POD, config


async def store(index: MemoryIndex, pod: str, dp_rank: int, tokens: list[int]) -> None:
    blocks = len(tokens) // index.block_size
    hashes = [EngineHash(1000 + i) for i in range(blocks)]
    event = StoreBlocks(hashes, None, tokens[: blocks * index.block_size], index.block_size,
                        Tier.GPU, root_key("m"))  # fmt: skip
    await index.apply(SourceBatch(Source(pod, dp_rank), 0, 0.0, [event]))


async def test_prefix_policy_on_a_memory_index_in_simulated_time() -> None:
    index = MemoryIndex(4)
    await store(index, "pod-a", 1, list(range(16)))
    await store(index, "pod-b", 0, list(range(8)))
    lookup = IndexLookup(index)
    prompt = list(range(20))
    result = await lookup.lookup("m", prompt)
    policy = build_policy("prefix", Random(1))
    loads = LoadTracker()
    workers = [("wa", "pod-a"), ("wb", "pod-b")]
    first = policy.choose(RouteQuery(prompt, lookup=result, now=0.0), loads.candidates(workers))
    assert (first.worker, first.dp_rank, first.hit_tokens, first.uncached_tokens) == (
        "wa",
        1,
        16,
        4,
    )
    ticket = loads.start_prefill(Choice(first.worker, uncached_tokens=first.uncached_tokens + 20))
    second = policy.choose(RouteQuery(prompt, lookup=result, now=1.0), loads.candidates(workers))
    assert second.worker == "wb", "24 queued on pod-a outweighs its 8 extra cached tokens"
    loads.finish(ticket)
    third = policy.choose(RouteQuery(prompt, lookup=result, now=2.0), loads.candidates(workers))
    assert third.worker == "wa"


async def test_redis_url_wires_the_redis_index_and_the_shared_registry(redis_url: str) -> None:
    cfg = config(redis_url=redis_url, block_size=4, redis_prefix="gkvtest")
    async with AsyncExitStack() as stack, httpx.AsyncClient() as client:
        lookup, registrar = await _index_parts(cfg, client, stack)
        assert lookup is not None
        assert registrar is not None
        result = await lookup.lookup("m", list(range(9)))
        assert (result.block_size, result.blocks, result.pods) == (4, 2, [])
        await registrar.register(POD)
        redis = aioredis.Redis.from_url(redis_url)
        try:
            stored = await RedisRegistry(redis, prefix="gkvtest").get("pod-a")
        finally:
            await redis.aclose()
        assert stored is not None
        assert (stored.model, stored.dp_size, stored.bootstrap_port) == ("m", 2, 8998)
        await registrar.unregister("pod-a")
