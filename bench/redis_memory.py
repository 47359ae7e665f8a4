"""Redis memory per stored (block, source) entry, and RedisIndex.apply throughput.

Two populations on a throw-away redis-server, written through `RedisIndex.apply` in large
batches by one writer task per source, all in this one process:
- unique: every pod holds chains nobody else holds (one holder per block key);
- shared: every pod holds the same chains (8 holders per block key: a common prefix).
Memory is the `used_memory` delta of INFO memory per (block, source) entry; the same
entries in a MemoryIndex (tracemalloc) are printed beside it. Throughput is engine
blocks applied per second, set against `redis-benchmark` pipelined HSET on the same
server in the same run (Redis's own write ceiling on the machine it runs on).

    python -m bench.redis_memory [--blocks N] [--baseline REF]

`--baseline REF` adds rows for the indexes as of git ref REF (see bench.baseline).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import re
import subprocess
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from bench import baseline
from bench.redis_process import redis_server
from globalkv.index.base import Index, Source, SourceBatch, StoreBlocks, Tier
from globalkv.index.memory import MemoryIndex
from globalkv.index.redis import RedisIndex
from globalkv.keys import EngineHash, root_key

BLOCK = 16
CHAIN = 500
"""Blocks per chain (8k tokens)."""
BATCH = 1000
"""Engine blocks per applied batch."""


@dataclass
class Population:
    name: str
    pods: int
    chains: list[list[int]]
    shared: bool

    def per_pod(self, pod: int) -> list[list[int]]:
        if self.shared:
            return self.chains
        per = len(self.chains) // self.pods
        return self.chains[pod * per : (pod + 1) * per]

    @property
    def entries(self) -> int:
        return sum(len(self.per_pod(p)) for p in range(self.pods)) * CHAIN


def _chains(count: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(50_000) for _ in range(CHAIN * BLOCK)] for _ in range(count)]


def _batches(tokens_by_chain: list[list[int]]) -> list[list[StoreBlocks]]:
    """One source's chains as batches of `BATCH` engine blocks (a chain per event)."""
    namespace = root_key("bench-model")
    batches: list[list[StoreBlocks]] = [[]]
    size = 0
    next_hash = 1
    for tokens in tokens_by_chain:
        hashes = [EngineHash(next_hash + j) for j in range(CHAIN)]
        next_hash += CHAIN
        batches[-1].append(StoreBlocks(hashes, None, tokens, BLOCK, Tier.GPU, namespace))
        size += CHAIN
        if size >= BATCH:
            batches.append([])
            size = 0
    return [b for b in batches if b]


async def _write(index: Index, population: Population) -> float:
    """Apply the population, one task per source; returns engine blocks per second."""
    work = {Source(f"pod{p}"): _batches(population.per_pod(p)) for p in range(population.pods)}

    async def writer(source: Source, batches: list[list[StoreBlocks]]) -> None:
        for seq, events in enumerate(batches):
            await index.apply(SourceBatch(source, seq, 0.0, events))

    start = time.perf_counter()
    await asyncio.gather(*(writer(s, b) for s, b in work.items()))
    elapsed = time.perf_counter() - start
    blocks = sum(len(e.hashes) for b in work.values() for events in b for e in events)
    return blocks / elapsed


async def _used_memory(client: aioredis.Redis) -> int:
    info = await client.info("memory")
    return int(info["used_memory"])


async def _memory_index_bytes(
    population: Population, memory_index: Callable[[int], Index]
) -> float:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = memory_index(BLOCK)
    await _write(index, population)
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del index
    return used / population.entries


def _redis_benchmark_hset(port: int, requests: int) -> float:
    """Requests/s of pipelined HSET (-P 64), Redis's own write ceiling."""
    argv = ["redis-benchmark", "-p", str(port), "-q", "-t", "hset", "-P", "64", "-n", str(requests)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    match = re.search(r"HSET: ([\d.]+) requests per second", out.stdout.replace("\r", "\n"))
    if match is None:
        raise SystemExit(f"cannot read redis-benchmark output: {out.stdout!r}")
    return float(match.group(1))


async def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=400_000, help="entries per population")
    parser.add_argument("--baseline", metavar="REF", help="also run the index as of git REF")
    args = parser.parse_args(argv)
    versions: list[tuple[str, Callable[[int], Index], Callable[..., Index]]] = []
    if args.baseline:
        old = baseline.load(args.baseline).index
        versions.append((f"@{args.baseline}", old.memory.MemoryIndex, old.redis.RedisIndex))
    versions.append(("", MemoryIndex, RedisIndex))
    rng = random.Random(7)
    chains = max(16, args.blocks // CHAIN)
    populations = [
        Population("unique", 16, _chains(chains, rng), shared=False),
        Population("shared x8", 8, _chains(max(1, chains // 8), rng), shared=True),
    ]
    print(f"{'population':>20} {'entries':>9} {'redis B/entry':>13} {'memory B/entry':>14}", end="")
    print(f" {'apply blocks/s':>14} {'HSET -P64 /s':>13} {'ratio':>6}")
    for population in populations:
        for name, memory_index, redis_index in versions:
            memory_bytes = await _memory_index_bytes(population, memory_index)
            with redis_server() as port:
                client = aioredis.from_url(f"redis://127.0.0.1:{port}/0")
                before = await _used_memory(client)
                rate = await _write(redis_index(client, BLOCK), population)
                used = await _used_memory(client) - before
                ceiling = _redis_benchmark_hset(port, 2_000_000)
                await client.aclose()
            print(
                f"{population.name + name:>20} {population.entries:>9}"
                f" {used / population.entries:>13.1f} {memory_bytes:>14.1f} {rate:>14.0f}"
                f" {ceiling:>13.0f} {rate / ceiling:>6.2f}"
            )


if __name__ == "__main__":
    asyncio.run(main())
