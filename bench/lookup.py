"""Lookup latency of MemoryIndex, RedisIndex and NVIDIA Dynamo's RadixTree, side by side.

Per prompt length (1k, 8k, 32k, 128k tokens; index block 16) and pod count (8, 64), the
same data goes into every index: pod i holds the first (i+1)/pods of the prompt's held
part (so a lookup walks all of it and a pod's run ends at every step of the way), plus
background chains of its own. With `--new-tail F` the last fraction F of the prompt is
held by nobody (a conversation's new turn). One lookup = what `IndexLookup` does from the
token ids (our chained xxh3 keys, hashed lazily as the memory index walks them) + the
index query; Dynamo's = `compute_block_hash_for_seq` (tokens to u32 and hashed, in Rust)
+ `find_matches` + reading `.scores`, the same work from the same token list. Each row
reports p50/p99 over the same number of lookups per backend, backends taking turns, and
p50 ratios against Dynamo.

    python -m bench.lookup [--quick] [--new-tail 0.5] [--baseline REF] [--tokens 1024 8192]
        [--no-cluster] [--repeat N]

`--baseline REF` adds the memory and Redis indexes as of git ref REF (see bench.baseline),
run turn by turn with today's: before and after in one run. `--repeat N` times each row
N times over the same data and reports the medians of the N p50s and p99s.

Redis is a throw-away redis-server on a free port; the `cluster` columns the same Redis
indexes on a throw-away local Redis Cluster of 3 masters (no replicas, one key prefix per
index), with `cluster/redis`, the ratio of their p50s (goal at 8k tokens: <= 1.5), and
the servers' CPU per lookup (of every index each serves).
Dynamo's columns need the `ai-dynamo-runtime` wheel (run from a venv that has it, e.g.
/work/peers/venv with globalkv installed editable); without it they are absent and the
output says why.
Targets: RedisIndex p50 <= 1 ms at 8k tokens (a lookup per request must not be the gateway's
largest cost); MemoryIndex <= 2x Dynamo's Rust radix tree.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from bench import baseline
from bench.redis_process import cpu_seconds, redis_cluster, redis_server
from globalkv.index.base import Index, Source, SourceBatch, StoreBlocks, Tier
from globalkv.index.memory import MemoryIndex
from globalkv.index.redis import RedisIndex
from globalkv.keys import BlockKey, EngineHash, request_chain, root_key
from globalkv.redis_client import Client, connect
from globalkv.stack.redis_cluster import LocalRedisCluster

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

Keyer = Callable[[Sequence[int], int, str], Sequence[BlockKey]]


@dataclass
class Row:
    tokens: int
    pods: int
    p50: dict[str, float]
    p99: dict[str, float]


@dataclass
class Backend:
    """An index implementation and the key function its lookups start from."""

    name: str
    memory: Callable[[int], Index]
    redis: Callable[..., Index]
    """(client, block size, prefix=...) -> the Redis index."""
    keys: Keyer
    db: int


def _chains(
    prompt_tokens: int, pods: int, new_tail: float, rng: random.Random
) -> list[list[list[int]]]:
    """Per pod, the token lists of the chains it holds (first: its part of the prompt)."""
    prompt = [rng.randrange(50_000) for _ in range(prompt_tokens)]
    held_part = int(prompt_tokens * (1 - new_tail))
    per_pod = []
    for i in range(pods):
        held = held_part * (i + 1) // pods // BLOCK * BLOCK
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
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Milliseconds per lookup, and this process's CPU µs per lookup (the client's part,
    which load on the machine delays but does not inflate); backends take turns, so
    machine load hits them alike."""
    for call in calls.values():
        for _ in range(min(20, count)):
            assert await call() == expect
    samples: dict[str, list[float]] = {name: [] for name in calls}
    cpu = dict.fromkeys(calls, 0.0)
    for _ in range(count):
        for name, call in calls.items():
            start, start_cpu = time.perf_counter_ns(), time.process_time_ns()
            depth = await call()
            cpu[name] += (time.process_time_ns() - start_cpu) / 1e3 / count
            samples[name].append((time.perf_counter_ns() - start) / 1e6)
            assert depth == expect
    return samples, cpu


def _p99(samples: Sequence[float]) -> float:
    return sorted(samples)[min(len(samples) - 1, int(len(samples) * 0.99))]


async def _row(
    prompt_tokens: int,
    pods: int,
    count: int,
    new_tail: float,
    redis_port: int,
    backends: list[Backend],
    cluster: LocalRedisCluster | None,
    repeat: int = 1,
) -> Row:
    chains = _chains(prompt_tokens, pods, new_tail, random.Random(prompt_tokens * 1000 + pods))
    prompt = chains[-1][0]
    expect = len(chains[-2][0]) // BLOCK
    calls: dict[str, Callable[[], Awaitable[int]]] = {}
    clients: list[Client] = []

    def ask(index: Index, keys: Keyer) -> Callable[[], Awaitable[int]]:
        async def call() -> int:
            hits = await index.lookup(keys(prompt, BLOCK, MODEL))
            return hits[0].blocks

        return call

    for backend in backends:
        memory = backend.memory(BLOCK)
        await _fill(memory, chains)
        client = aioredis.from_url(f"redis://127.0.0.1:{redis_port}/{backend.db}")
        clients.append(client)
        await client.flushdb()
        redis_index = backend.redis(client, BLOCK)
        await _fill(redis_index, chains)
        calls[f"memory{backend.name}"] = ask(memory, backend.keys)
        calls[f"redis{backend.name}"] = ask(redis_index, backend.keys)
    if cluster is not None:
        clustered = connect(cluster.url)
        clients.append(clustered)
        await clustered.flushall()
        for backend in backends:  # one cluster, one prefix per backend
            cluster_index = backend.redis(clustered, BLOCK, prefix=f"c{backend.db}")
            await _fill(cluster_index, chains)
            calls[f"cluster{backend.name}"] = ask(cluster_index, backend.keys)
    if DYNAMO is None:
        tree = RadixTree()
        _fill_dynamo(tree, chains)

        async def ask_dynamo() -> int:
            scores = tree.find_matches(compute_block_hash_for_seq(prompt, BLOCK)).scores
            return int(max(scores.values()))

        calls["dynamo"] = ask_dynamo
    masters = [] if cluster is None else cluster.master_ports()
    before = cpu_seconds([redis_port, *masters])
    timed = [await _time(calls, count, expect) for _ in range(repeat)]
    runs = [samples for samples, _ in timed]
    # Every backend took its turn: each server's CPU went to its own index's lookups
    # (with a baseline, the single Redis and the cluster serve its index too).
    per_lookup = [
        (b - a) / (count * repeat) * 1e6
        for a, b in zip(before, cpu_seconds([redis_port, *masters]), strict=True)
    ]
    if masters:
        print(
            f"  {prompt_tokens} tokens, {pods} pods: redis-server CPU per lookup: single "
            f"{per_lookup[0]:.0f} µs, cluster {sum(per_lookup[1:]):.0f} µs (per master "
            f"{', '.join(f'{us:.0f}' for us in per_lookup[1:])})"
        )
    client_cpu = {name: statistics.median(cpu[name] for _, cpu in timed) for name in calls}
    print(
        f"  {prompt_tokens} tokens, {pods} pods: client CPU per lookup: "
        + ", ".join(f"{name} {us:.0f} µs" for name, us in client_cpu.items())
    )
    for opened in clients:
        await opened.aclose()
    return Row(
        prompt_tokens,
        pods,
        {name: statistics.median(statistics.median(r[name]) for r in runs) for name in calls},
        {name: statistics.median(_p99(r[name]) for r in runs) for name in calls},
    )


def _print(rows: list[Row]) -> None:
    names = list(rows[0].p50)
    versus = [n for n in names if n != "dynamo"] if "dynamo" in names else []
    clustered = [n.removeprefix("cluster") for n in names if n.startswith("cluster")]
    head = f"{'tokens':>7} {'pods':>4} " + " ".join(f"{n + ' p50/p99 ms':>24}" for n in names)
    head += "".join(f" {n + '/dynamo':>{max(12, len(n) + 7)}}" for n in versus)
    head += "".join(f" {f'cluster{n}/redis{n}':>{max(14, 2 * len(n) + 14)}}" for n in clustered)
    print(head)
    for row in rows:
        line = f"{row.tokens:>7} {row.pods:>4} "
        line += " ".join(f"{row.p50[n]:>12.3f} / {row.p99[n]:>9.3f}" for n in names)
        for n in versus:
            line += f" {row.p50[n] / row.p50['dynamo']:>{max(12, len(n) + 7)}.2f}"
        for n in clustered:
            ratio = row.p50[f"cluster{n}"] / row.p50[f"redis{n}"]
            line += f" {ratio:>{max(14, 2 * len(n) + 14)}.2f}"
        print(line)


def _backends(ref: str | None) -> list[Backend]:
    backends = [Backend("", MemoryIndex, RedisIndex, request_chain, 0)]
    if ref is not None:
        old = baseline.load(ref)
        keys = old.keys.request_keys
        backends.insert(
            0, Backend(f"@{ref}", old.index.memory.MemoryIndex, old.index.redis.RedisIndex, keys, 1)
        )
    return backends


async def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer lookups per row")
    parser.add_argument(
        "--new-tail", type=float, default=0.0, help="fraction of the prompt nobody holds"
    )
    parser.add_argument("--baseline", metavar="REF", help="also run the index as of git REF")
    parser.add_argument(
        "--tokens", type=int, nargs="+", default=list(PROMPTS), help="prompt lengths to run"
    )
    parser.add_argument(
        "--no-cluster", action="store_true", help="leave out the 3-master cluster column"
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="time each row N times, report the medians"
    )
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if not 0 <= args.new_tail < 1:
        parser.error("--new-tail must be in [0, 1)")
    if DYNAMO is not None:
        print(DYNAMO)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores at the start")
    backends = _backends(args.baseline)
    rows = []
    with redis_server() as port, contextlib.ExitStack() as stack:
        cluster = None if args.no_cluster else stack.enter_context(redis_cluster())
        for tokens in args.tokens:
            for pods in PODS:
                # At least 100 lookups per row: long prompts' p50 was noise over 20.
                count = (200_000 if not args.quick else 50_000) // (tokens // BLOCK)
                count = min(1000, max(100 if not args.quick else 20, count))
                row = await _row(
                    tokens, pods, count, args.new_tail, port, backends, cluster, args.repeat
                )
                rows.append(row)
    _print(rows)


if __name__ == "__main__":
    asyncio.run(main())
