"""Freshness: time from an engine publishing a block to a lookup seeing it, under load.

    python -m bench.freshness [--rate 50000] [--seconds 5] [--blocks-per-batch 16]

A publisher child process sends `--rate` blocks/s (batches of `--blocks-per-batch` new
16-token blocks, each batch a fresh chain whose first token is its seq) for `--seconds`,
and reports when it sent each batch. This process runs the real `IngestService` into
`MemoryIndex` and into `RedisIndex` (throw-away redis-server). A thin wrapper around the
index notes when each batch's apply returned ("applied") and, for one batch in
`--probe-every`, runs a real lookup of its chain right then ("visible": what a gateway
would see). Both clocks are this machine's wall clock.

`--gc tuned` runs the indexer side as `gateway.serving.launch` runs the gateway: startup
objects frozen out of the collector (`gc.freeze()`) and young collections at 10,000
allocations instead of 700 (`--gc both` runs each index both ways). Every run reports the
collections that ran and the longest pause per generation. `--baseline REF` adds the
indexes as of git ref REF (see bench.baseline), run one after the other with today's.

Target: publish → visible in a lookup, p99, under 50k blocks/s, well inside the gateway's
pending-prompt grace (seconds), which covers what the index does not show yet.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import redis.asyncio as aioredis
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from bench import baseline
from bench.ingest import BLOCK, free_port
from bench.redis_process import redis_server
from globalkv.index.base import (
    ApplyResult,
    Hit,
    Index,
    Source,
    SourceBatch,
    SourceStats,
    StoreBlocks,
)
from globalkv.index.memory import MemoryIndex
from globalkv.index.redis import RedisIndex
from globalkv.ingest.config import IngestConfig
from globalkv.ingest.service import IngestService
from globalkv.keys import BlockKey, EngineHash, chain_keys
from globalkv.metrics import IngestMetrics
from globalkv.registry import KvEventsConfig, MemoryRegistry, PodInfo
from globalkv.wire import BlockStored, EventBatch, encode_batch, live_frames


def publisher_main(endpoint: str, rate: float, seconds: float, blocks: int) -> None:
    """Child: paced publishing; prints `{"sent": {seq: wall time}}` when done."""
    context = zmq.Context()
    pub = context.socket(zmq.XPUB)
    pub.sndhwm = 0
    pub.bind(endpoint)
    print("ready", flush=True)
    while pub.recv()[:1] != b"\x01":
        pass
    sys.stdin.readline()
    total = int(rate * seconds / blocks)
    per_second = rate / blocks
    sent: dict[int, float] = {}
    start = time.perf_counter()
    seq = 0
    while seq < total:
        due = min(total, int((time.perf_counter() - start) * per_second) + 1)
        while seq < due:
            tokens = [seq, *((seq * 31 + i) % 50_000 for i in range(blocks * BLOCK - 1))]
            hashes = [EngineHash(seq * blocks + i + 1) for i in range(blocks)]
            event = BlockStored(hashes, None, tokens, BLOCK, medium="GPU")
            now = time.time()
            payload = encode_batch(EventBatch(ts=now, events=[event], dp_rank=0), "vllm")
            pub.send_multipart(live_frames(b"", seq, payload))
            sent[seq] = now
            seq += 1
        time.sleep(0.0005)
    print(json.dumps({"sent": sent, "elapsed": time.perf_counter() - start}), flush=True)
    sys.stdin.readline()
    pub.close(linger=0)
    context.term()


class ProbeIndex:
    """Delegates to a real index and records when batches became visible."""

    def __init__(self, inner: Index, probe_every: int) -> None:
        self.inner = inner
        self.block_size = inner.block_size
        self.probe_every = probe_every
        self.applied_at: dict[int, float] = {}
        self.visible_at: dict[int, float] = {}

    async def apply(self, batch: SourceBatch) -> ApplyResult:
        result = await self.inner.apply(batch)
        now = time.time()
        stores = [e for e in batch.events if isinstance(e, StoreBlocks)]
        for store in stores:
            self.applied_at[store.token_ids[0]] = now
        for store in stores:
            seq = store.token_ids[0]
            if seq % self.probe_every:
                continue
            keys = chain_keys(store.namespace, store.token_ids, self.block_size)
            hits = await self.inner.lookup(keys)
            if any(h.source == batch.source and h.blocks == len(keys) for h in hits):
                self.visible_at[seq] = time.time()
        return result

    async def lookup(self, keys: Sequence[BlockKey]) -> list[Hit]:
        return await self.inner.lookup(keys)

    async def reset_source(self, source: Source) -> None:
        await self.inner.reset_source(source)

    async def remove_pod(self, pod: str) -> None:
        await self.inner.remove_pod(pod)

    async def stats(self, pod: str | None = None) -> list[SourceStats]:
        return await self.inner.stats(pod)

    async def close(self) -> None:
        await self.inner.close()


class GcWatch:
    """Collections per generation and the longest pause of each, while installed."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.longest = [0.0, 0.0, 0.0]
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        generation = info["generation"]
        self.count[generation] += 1
        self.longest[generation] = max(
            self.longest[generation], time.perf_counter() - self._started
        )

    def __str__(self) -> str:
        return ", ".join(
            f"gen{g} {self.count[g]} (longest {self.longest[g] * 1e3:.1f} ms)" for g in range(3)
        )


@contextmanager
def collector(mode: str) -> Iterator[GcWatch]:
    """The GC set up as `mode` says, watched, and put back as it was after."""
    thresholds = gc.get_threshold()
    watch = GcWatch()
    gc.collect()  # nothing left over from an earlier run
    if mode == "tuned":
        gc.freeze()
        gc.set_threshold(10_000, *thresholds[1:])
    gc.callbacks.append(watch)
    try:
        yield watch
    finally:
        gc.callbacks.remove(watch)
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def percentiles(values: list[float]) -> str:
    if len(values) < 2:
        return "n/a"
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    p50, p99, top = cuts[49] * 1e3, cuts[98] * 1e3, max(values) * 1e3
    return f"p50 {p50:7.2f} ms   p99 {p99:7.2f} ms   max {top:7.2f} ms"


async def measure(index: Index, args: argparse.Namespace, gc_mode: str) -> str:
    probe = ProbeIndex(index, args.probe_every)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    child = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "bench.freshness", "--publisher", endpoint],
        *["--rate", str(args.rate), "--seconds", str(args.seconds)],
        *["--blocks-per-batch", str(args.blocks_per_batch)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        limit=1 << 26,
    )
    context = zmq.asyncio.Context()
    service = IngestService(
        probe,
        MemoryRegistry(),
        IngestMetrics(CollectorRegistry()),
        IngestConfig(rcvhwm=1_000_000, queue_size=100_000),
        context=context,
    )
    try:
        assert child.stdout is not None
        assert child.stdin is not None
        await child.stdout.readline()
        pod = PodInfo(id="fresh", model="m", kv_events=KvEventsConfig(endpoint=endpoint))
        await service.following.add(pod)
        with collector(gc_mode) as watch:
            child.stdin.write(b"go\n")
            await child.stdin.drain()
            report = json.loads(await child.stdout.readline())
            sent = {int(k): v for k, v in report["sent"].items()}
            await service.followed.applied(Source("fresh"), max(sent), timeout=120)
        child.stdin.write(b"done\n")
        await child.stdin.drain()
    finally:
        await service.stop()
        context.destroy(linger=0)
        async with asyncio.timeout(30):
            await child.wait()
    applied = [probe.applied_at[s] - t for s, t in sent.items() if s in probe.applied_at]
    visible = [probe.visible_at[s] - t for s, t in sent.items() if s in probe.visible_at]
    achieved = len(sent) * args.blocks_per_batch / report["elapsed"]
    return (
        f"    published {achieved:,.0f} blocks/s for {report['elapsed']:.1f}s\n"
        f"    applied  ({len(applied):>6} batches)  {percentiles(applied)}\n"
        f"    visible  ({len(visible):>6} lookups)  {percentiles(visible)}\n"
        f"    collections: {watch}"
    )


async def run(args: argparse.Namespace) -> None:
    print(
        f"freshness at {args.rate:,.0f} blocks/s, batches of {args.blocks_per_batch} blocks "
        f"of {BLOCK} tokens, publisher in another process (load average "
        f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores at the start)"
    )
    versions: list[tuple[str, Callable[[int], Index], Callable[..., Index]]] = []
    if args.baseline:
        old = baseline.load(args.baseline).index
        versions.append((f"@{args.baseline}", old.memory.MemoryIndex, old.redis.RedisIndex))
    versions.append(("", MemoryIndex, RedisIndex))
    modes = ["default", "tuned"] if args.gc == "both" else [args.gc]
    for mode in modes:
        for name, memory_index, _ in versions:
            print(f"  MemoryIndex{name}, gc {mode}")
            print(await measure(memory_index(BLOCK), args, mode))
    with redis_server() as port:
        client = aioredis.from_url(f"redis://127.0.0.1:{port}/0")
        for mode in modes:
            for name, _, redis_index in versions:
                await client.flushall()
                print(f"  RedisIndex{name}, gc {mode}")
                print(await measure(redis_index(client, BLOCK), args, mode))
        await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=50_000, help="blocks per second")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--blocks-per-batch", type=int, default=16)
    parser.add_argument("--probe-every", type=int, default=16, help="one lookup per N batches")
    parser.add_argument("--gc", choices=["default", "tuned", "both"], default="default")
    parser.add_argument("--baseline", metavar="REF", help="also run the index as of git REF")
    parser.add_argument("--publisher", metavar="ENDPOINT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.publisher:
        publisher_main(args.publisher, args.rate, args.seconds, args.blocks_per_batch)
    else:
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
