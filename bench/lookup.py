"""Lookup latency of MemoryIndex, RedisIndex and NVIDIA Dynamo's RadixTree, side by side.

Per prompt length (1k, 8k, 32k, 128k tokens; index block 16) and pod count (8, 64), the
same data goes into every index: pod i holds the first (i+1)/pods of the prompt's chain
(so a lookup walks the whole chain and a pod's run ends at every step of the way), plus
background chains of its own. One lookup = keys computed from the tokens (our chained
xxh3 keys; Dynamo's `compute_block_hash_for_seq`) + the index query. Each row reports
p50/p99 over the same number of lookups per backend, and p50 ratios against Dynamo.

    python -m bench.lookup [--quick]

Redis is a throw-away redis-server on a free port. Dynamo's columns need the
`ai-dynamo-runtime` wheel (run from a venv that has it, e.g. /work/peers/venv with
globalkv installed editable); without it they are absent and the output says why.
Goals (issue 3): RedisIndex p50 <= 1 ms at 8k tokens; MemoryIndex <= 2x Dynamo.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from bench.redis_process import redis_server
from globalkv.index.base import Index, Source, SourceBatch, StoreBlocks, Tier
from globalkv.index.memory import MemoryIndex
from globalkv.index.redis import RedisIndex
from globalkv.keys import BlockKey, EngineHash, request_keys, root_key

BLOCK = 16
MODEL = "bench-model"
PROMPTS = (1024, 8192, 32768, 131072)
PODS = (8, 64)
BACKGROUND_CHAINS = 4
BACKGROUND_BLOCKS = 256
STORE_BATCH = 512

try:
    from dynamo._core import RadixTree, compute_block_hash_for_seq

    DYNAMO: str | None = None
except ImportError as exc:
    DYNAMO = f"Dynamo columns absent: ai-dynamo-runtime is not installed here ({exc})"


@dataclass
class Row:
    tokens: int
    pods: int
    p50: dict[str, float]
    p99: dict[str, float]


def _chains(prompt_tokens: int, pods: int, rng: random.Random) -> list[list[list[int]]]:
    """Per pod, the token lists of the chains it holds (first: its part of the prompt)."""
    prompt = [rng.randrange(50_000) for _ in range(prompt_tokens)]
    per_pod = []
    for i in range(pods):
        held = prompt_tokens * (i + 1) // pods // BLOCK * BLOCK
        chains = [prompt[:held]]
        for _ in range(BACKGROUND_CHAINS):
            chains.append([rng.randrange(50_000) for _ in range(BACKGROUND_BLOCKS * BLOCK)])
        per_pod.append(chains)
    per_pod.append([prompt])  # the query, last
    return per_pod


def _engine_hashes(chains: list[list[list[int]]]) -> list[list[list[int]]]:
    """Per pod and chain, its blocks' engine hashes: equal for equal prefixes across pods
    (the prompt, chain 0), as engines hash them; unique for background chains."""
    out = []
    unique = 1 << 40
    for pod_chains in chains[:-1]:
        hashes = [list(range(1, len(pod_chains[0]) // BLOCK + 1))]
        for tokens in pod_chains[1:]:
            hashes.append(list(range(unique, unique + len(tokens) // BLOCK)))
            unique += len(tokens) // BLOCK
        out.append(hashes)
    return out


async def _fill(index: Index, chains: list[list[list[int]]]) -> None:
    namespace = root_key(MODEL)
    for pod, pod_hashes in enumerate(_engine_hashes(chains)):
        source = Source(f"pod{pod}")
        seq = 0
        for tokens, hashes in zip(chains[pod], pod_hashes, strict=True):
            parent: EngineHash | None = None
            for start in range(0, len(hashes), STORE_BATCH):
                part = [EngineHash(h) for h in hashes[start : start + STORE_BATCH]]
                part_tokens = tokens[start * BLOCK : (start + len(part)) * BLOCK]
                event = StoreBlocks(part, parent, part_tokens, BLOCK, Tier.GPU, namespace)
                await index.apply(SourceBatch(source, seq, 0.0, [event]))
                seq += 1
                parent = part[-1]


def _fill_dynamo(tree: Any, chains: list[list[list[int]]]) -> None:
    event_id = 0
    for pod, pod_hashes in enumerate(_engine_hashes(chains)):
        for tokens, hashes in zip(chains[pod], pod_hashes, strict=True):
            local = compute_block_hash_for_seq(tokens, BLOCK)
            parent = None
            for start in range(0, len(hashes), STORE_BATCH):
                blocks = [
                    {"block_hash": h, "tokens_hash": t}
                    for h, t in zip(
                        hashes[start : start + STORE_BATCH], local[start:], strict=False
                    )
                ]
                event_id += 1
                stored = {"parent_hash": parent, "blocks": blocks}
                tree.apply_event(
                    pod, json.dumps({"event_id": event_id, "data": {"stored": stored}}).encode()
                )
                parent = blocks[-1]["block_hash"]


async def _time(
    calls: dict[str, Callable[[], Awaitable[int]]], count: int, expect: int
) -> dict[str, list[float]]:
    """Milliseconds per lookup; backends take turns, so machine load hits them alike."""
    for call in calls.values():
        for _ in range(min(20, count)):
            assert await call() == expect
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(count):
        for name, call in calls.items():
            start = time.perf_counter_ns()
            depth = await call()
            samples[name].append((time.perf_counter_ns() - start) / 1e6)
            assert depth == expect
    return samples


def _p99(samples: Sequence[float]) -> float:
    return sorted(samples)[min(len(samples) - 1, int(len(samples) * 0.99))]


async def _row(prompt_tokens: int, pods: int, count: int, redis_port: int) -> Row:
    chains = _chains(prompt_tokens, pods, random.Random(prompt_tokens * 1000 + pods))
    prompt = chains[-1][0]
    expect = prompt_tokens // BLOCK
    memory = MemoryIndex(BLOCK)
    client = aioredis.from_url(f"redis://127.0.0.1:{redis_port}/0")
    await client.flushall()
    redis_index = RedisIndex(client, BLOCK)
    await _fill(memory, chains)
    await _fill(redis_index, chains)

    async def ask(index: Index) -> int:
        keys: list[BlockKey] = request_keys(prompt, BLOCK, MODEL)
        hits = await index.lookup(keys)
        return hits[0].blocks

    calls: dict[str, Callable[[], Awaitable[int]]] = {
        "memory": lambda: ask(memory),
        "redis": lambda: ask(redis_index),
    }
    if DYNAMO is None:
        tree = RadixTree()
        _fill_dynamo(tree, chains)

        async def ask_dynamo() -> int:
            scores = tree.find_matches(compute_block_hash_for_seq(prompt, BLOCK)).scores
            return int(max(scores.values()))

        calls["dynamo"] = ask_dynamo
    samples = await _time(calls, count, expect)
    await client.aclose()
    return Row(
        prompt_tokens,
        pods,
        {name: statistics.median(s) for name, s in samples.items()},
        {name: _p99(s) for name, s in samples.items()},
    )


def _print(rows: list[Row]) -> None:
    names = list(rows[0].p50)
    head = f"{'tokens':>7} {'pods':>4} " + " ".join(f"{n + ' p50/p99 ms':>22}" for n in names)
    if "dynamo" in names:
        head += f" {'memory/dynamo':>13} {'redis/dynamo':>12}"
    print(head)
    for row in rows:
        line = f"{row.tokens:>7} {row.pods:>4} "
        line += " ".join(f"{row.p50[n]:>10.3f} / {row.p99[n]:>9.3f}" for n in names)
        if "dynamo" in names:
            dynamo = row.p50["dynamo"]
            line += f" {row.p50['memory'] / dynamo:>13.2f} {row.p50['redis'] / dynamo:>12.2f}"
        print(line)


async def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer lookups per row")
    args = parser.parse_args(argv)
    if DYNAMO is not None:
        print(DYNAMO)
    rows = []
    with redis_server() as port:
        for tokens in PROMPTS:
            for pods in PODS:
                count = max(20, (200_000 if not args.quick else 50_000) // (tokens // BLOCK))
                rows.append(await _row(tokens, pods, min(count, 1000), port))
    _print(rows)


if __name__ == "__main__":
    asyncio.run(main())
