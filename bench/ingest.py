"""Ingest throughput: engine PUB → ZMQ → decode → translate → index, in blocks per second.

    python -m bench.ingest [--batches 3000] [--blocks-per-batch 32] [--repeat 3] [--baseline REF]

A publisher child process (an engine stand-in) pre-encodes `--batches` vLLM batches, each
one BlockStored of `--blocks-per-batch` 16-token blocks continuing one of 64
conversations, waits for the indexer's subscription, then sends them all as fast as ZMQ
takes them. This process runs the real `IngestService` into `MemoryIndex`, into
`RedisIndex` on a throw-away `redis-server` and into `RedisIndex` on a throw-away local
Redis Cluster of 3 masters (no replicas), and times first-applied → last-applied; the
redis-servers' own CPU per block is read from `INFO cpu` around each run.
The denominator for Redis is `redis-benchmark` pipelined HSET on the same server, same
run: one HSET is the cheapest conceivable "record one block for one pod". `--baseline REF`
adds the indexes as of git ref REF (see bench.baseline), run in turn with today's.

Targets: ≥ 300k blocks/s into memory, ≥ 100k into Redis, from one process (a busy
prefill cluster publishes tens of thousands of blocks per second).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgpack
import redis.asyncio as aioredis
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from bench import baseline
from bench.redis_process import cpu_seconds, redis_cluster, redis_server
from globalkv.index.base import ApplyResult, Hit, Index, Source, SourceBatch, SourceStats
from globalkv.index.memory import MemoryIndex
from globalkv.index.redis import RedisIndex
from globalkv.ingest.config import IngestConfig
from globalkv.ingest.service import IngestService
from globalkv.keys import BlockKey
from globalkv.metrics import IngestMetrics
from globalkv.redis_client import connect
from globalkv.registry import KvEventsConfig, MemoryRegistry, PodInfo
from globalkv.wire import live_frames
from kvplumbing.ports import unclaimed_ports

BLOCK = 16
CONVERSATIONS = 64


def free_port() -> int:
    return unclaimed_ports(1)[0]


def redis_benchmark_hset(port: int, requests: int = 1_000_000) -> float:
    """HSET requests/s, pipelined by 64, one client (like one indexer connection)."""
    argv = ["redis-benchmark", "-p", str(port), "-q", "-t", "hset", "-n", str(requests)]
    out = subprocess.run(
        [*argv, "-P", "64", "-c", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    match = re.search(r"HSET:\s*([\d.]+)\s*requests per second", out.replace("\r", "\n"))
    if match is None:
        raise SystemExit(f"cannot read redis-benchmark output: {out!r}")
    return float(match.group(1))


def payloads(batches: int, blocks: int, ts: float = 0.0) -> list[bytes]:
    """vLLM ≥ 0.24 map payloads: each batch extends one conversation by `blocks` blocks."""
    out: list[bytes] = []
    last: dict[int, int | None] = dict.fromkeys(range(CONVERSATIONS))
    next_hash = 1
    for n in range(batches):
        conv = n % CONVERSATIONS
        hashes = list(range(next_hash, next_hash + blocks))
        next_hash += blocks
        tokens = [(conv * 7919 + n * 31 + i) % 50_000 for i in range(blocks * BLOCK)]
        event = {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": last[conv],
            "token_ids": tokens,
            "block_size": BLOCK,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        }
        last[conv] = hashes[-1]
        out.append(msgpack.packb([ts, [event], 0]))
    return out


def publisher_main(endpoints: list[str], batches: int, blocks: int) -> None:
    """Child: one PUB per pod; once all are subscribed and 'go' arrives on stdin, send
    every pod's batches interleaved; exit on 'done'."""
    context = zmq.Context()
    pubs = []
    for endpoint in endpoints:
        pub = context.socket(zmq.XPUB)
        pub.sndhwm = 0
        pub.bind(endpoint)
        pubs.append(pub)
    data = payloads(batches, blocks)
    print("ready", flush=True)
    for pub in pubs:
        while pub.recv()[:1] != b"\x01":
            pass
    print("subscribed", flush=True)
    sys.stdin.readline()
    for seq, payload in enumerate(data):
        for pub in pubs:
            pub.send_multipart(live_frames(b"", seq, payload))
    sys.stdin.readline()
    for pub in pubs:
        pub.close(linger=0)
    context.term()


class NullIndex:
    """Accepts every batch and keeps nothing: what the ingest path alone costs."""

    block_size = BLOCK

    async def apply(self, batch: SourceBatch) -> ApplyResult:
        return ApplyResult(stored=sum(len(getattr(e, "hashes", ())) for e in batch.events))

    async def lookup(self, keys: Sequence[BlockKey]) -> list[Hit]:
        return []

    async def reset_source(self, source: Source) -> None:
        return None

    async def remove_pod(self, pod: str) -> None:
        return None

    async def stats(self, pod: str | None = None) -> list[SourceStats]:
        return []

    async def close(self) -> None:
        return None


@dataclass(frozen=True, slots=True)
class Rate:
    wall: float
    """Blocks per second of elapsed time, publisher to last apply."""
    cpu: float
    """Blocks per CPU-second of this (the indexer's) process: steadier on a shared box."""


async def measure(index: Index, batches: int, blocks: int, pods: int) -> Rate:
    """Blocks/s applied by one IngestService from `pods` publishers in another process."""
    endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(pods)]
    argv = [sys.executable, "-m", "bench.ingest", "--publisher", ",".join(endpoints)]
    child = await asyncio.create_subprocess_exec(
        *argv,
        *["--batches", str(batches), "--blocks-per-batch", str(blocks)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    context = zmq.asyncio.Context()
    service = IngestService(
        index,
        MemoryRegistry(),
        IngestMetrics(CollectorRegistry()),
        IngestConfig(queue_size=batches, rcvhwm=1_000_000),
        context=context,
    )
    try:
        assert child.stdout is not None
        assert child.stdin is not None
        await child.stdout.readline()
        for n, endpoint in enumerate(endpoints):
            kv_events = KvEventsConfig(endpoint=endpoint)
            await service.following.add(PodInfo(id=f"pod{n}", model="m", kv_events=kv_events))
        await child.stdout.readline()
        start, cpu = time.perf_counter(), time.process_time()
        child.stdin.write(b"go\n")
        await child.stdin.drain()
        for n in range(pods):
            await service.followed.applied(Source(f"pod{n}"), batches - 1, timeout=600)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        child.stdin.write(b"done\n")
        await child.stdin.drain()
        total = batches * blocks * pods
        return Rate(total / elapsed, total / cpu)
    finally:
        await service.stop()
        context.destroy(linger=0)
        async with asyncio.timeout(30):
            await child.wait()


async def script_time(client: aioredis.Redis) -> tuple[int, float]:
    """EVALSHA calls and seconds redis-server spent running them since the last reset."""
    stats = await client.info("commandstats")
    entry = stats.get("cmdstat_evalsha", {"calls": 0, "usec": 0})
    return int(entry["calls"]), int(entry["usec"]) / 1e6


async def run(args: argparse.Namespace) -> None:
    versions: list[tuple[str, Callable[[int], Index], Callable[..., Index]]] = []
    if args.baseline:
        old = baseline.load(args.baseline).index
        versions.append((f"@{args.baseline}", old.memory.MemoryIndex, old.redis.RedisIndex))
    versions.append(("", MemoryIndex, RedisIndex))
    rates: dict[str, list[Rate]] = {"null": []}
    hset: list[float] = []
    scripts: list[tuple[int, float]] = []
    server_cpu: dict[str, list[list[float]]] = {"redis": [], "cluster": []}
    with redis_server() as port, redis_cluster() as cluster:
        client = aioredis.from_url(f"redis://127.0.0.1:{port}/0")
        clustered = connect(cluster.url)
        masters = cluster.master_ports()
        for _ in range(args.repeat):
            n, b, p = args.batches, args.blocks_per_batch, args.pods
            rates["null"].append(await measure(NullIndex(), n, b, p))
            for name, memory_index, _ in versions:
                rate = await measure(memory_index(BLOCK), n, b, p)
                rates.setdefault(f"memory{name}", []).append(rate)
            for name, _, redis_index in versions:
                await client.flushall()
                await client.config_resetstat()
                before = cpu_seconds([port])
                rate = await measure(redis_index(client, BLOCK), n, b, p)
                rates.setdefault(f"redis{name}", []).append(rate)
                if not name:
                    scripts.append(await script_time(client))
                    server_cpu["redis"].append(_spent(before, cpu_seconds([port])))
            await clustered.flushall()
            before = cpu_seconds(masters)
            rates.setdefault("cluster", []).append(
                await measure(RedisIndex(clustered, BLOCK), n, b, p)
            )
            server_cpu["cluster"].append(_spent(before, cpu_seconds(masters)))
            await client.flushall()
            hset.append(redis_benchmark_hset(port))
        await client.aclose()
        await clustered.aclose()
    med = statistics.median
    print(
        f"ingest, {args.pods} pods x {args.batches} batches x {args.blocks_per_batch} blocks "
        f"of {BLOCK} tokens, median of {args.repeat} runs side by side "
        f"(load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores at the end)"
    )
    print(f"  {'index':<40}{'blocks/s':>12}{'blocks/CPU-s':>15}")
    labels = {"null": "no-op index (ingest path only)"}
    for name, _, _ in versions:
        labels[f"memory{name}"] = f"MemoryIndex{name} (goal 300,000)"
    for name, _, _ in versions:
        labels[f"redis{name}"] = f"RedisIndex{name} (goal 100,000)"
    labels["cluster"] = "RedisIndex, 3-master Redis Cluster"
    for name, label in labels.items():
        wall = med(r.wall for r in rates[name])
        cpu = med(r.cpu for r in rates[name])
        print(f"  {label:<40}{wall:>12,.0f}{cpu:>15,.0f}")
    redis_wall = med(r.wall for r in rates["redis"])
    cluster_wall = med(r.wall for r in rates["cluster"])
    print(f"  cluster / single Redis: {cluster_wall / redis_wall:.2f} (goal >= 0.8)")
    blocks = args.batches * args.blocks_per_batch * args.pods
    for name in ("redis", "cluster"):
        runs = server_cpu[name]
        per_master = [med(run[i] for run in runs) for i in range(len(runs[0]))]
        shown = ", ".join(f"{s / blocks * 1e6:.1f}" for s in per_master)
        print(f"  redis-server CPU per block ({name}, per master): {shown} µs")
    print(f"  redis-benchmark HSET -P64 -c1: {med(hset):,.0f} requests/s")
    print(f"  RedisIndex ingest / HSET ceiling: {redis_wall / med(hset):.3f}")
    calls, busy = scripts[len(scripts) // 2]
    print(
        f"  inside redis-server: {calls} script calls, {busy:.2f}s busy in them "
        f"({busy / blocks * 1e6:.1f} µs per block) out of "
        f"{blocks / redis_wall:.2f}s elapsed"
    )


def _spent(before: list[float], after: list[float]) -> list[float]:
    return [b - a for a, b in zip(before, after, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument("--blocks-per-batch", type=int, default=32)
    parser.add_argument("--pods", type=int, default=1, help="publishers (sources) at once")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--baseline", metavar="REF", help="also run the index as of git REF")
    parser.add_argument("--publisher", metavar="ENDPOINT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.publisher:
        publisher_main(args.publisher.split(","), args.batches, args.blocks_per_batch)
    else:
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
