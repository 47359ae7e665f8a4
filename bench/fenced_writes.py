"""Fenced batch writes on a Redis Cluster (indexer replicas): time per batch, and what a
lease takeover costs, today beside the index as of `--baseline REF`.

    python -m bench.fenced_writes [--batches 400] [--blocks-per-batch 32] [--repeat 3] \
        [--baseline main]

On a throw-away local Redis Cluster of 3 masters (no replicas), a fenced `RedisIndex`
applies `--batches` batches of one source, each storing `--blocks-per-batch` 16-token
blocks that continue one of 8 conversations, under a lease taken with today's `Leases`.
Today each master's block call checks its copy of the fence; before the copies, the
writer read the fence on its own before the block calls. Versions run turn by turn,
`--repeat` times, so load from other processes hits both alike; the figures are medians.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench import baseline
from bench.redis_process import redis_cluster
from globalkv.index.base import Source, SourceBatch, StoreBlocks, Tier
from globalkv.index.redis import RedisIndex
from globalkv.ingest.leases import Grant, Leases
from globalkv.keys import EngineHash, root_key
from globalkv.redis_client import Client, connect

BLOCK = 16
CONVERSATIONS = 8
POD = "bench-pod"


def batches(count: int, blocks: int) -> list[SourceBatch]:
    """`count` batches, each continuing one of the conversations by `blocks` blocks."""
    last: list[int | None] = [None] * CONVERSATIONS
    out, next_hash = [], 1
    for seq in range(count):
        conv = seq % CONVERSATIONS
        hashes = list(range(next_hash, next_hash + blocks))
        next_hash += blocks
        tokens = [seq * 100_000 + i for i in range(blocks * BLOCK)]
        parent = last[conv]
        store = StoreBlocks(
            hashes=[EngineHash(h) for h in hashes],
            parent=None if parent is None else EngineHash(parent),
            token_ids=tokens,
            block_size=BLOCK,
            tier=Tier.GPU,
            namespace=root_key(f"conversation-{conv}"),
        )
        last[conv] = hashes[-1]
        out.append(SourceBatch(Source(POD), seq, float(seq), [store]))
    return out


async def measure(
    client: Client, make: Callable[..., Any], copies: bool, work: list[SourceBatch]
) -> tuple[float, float]:
    """Median seconds per batch, and the seconds one lease grant took."""
    await client.flushall()
    index = make(client, BLOCK, fenced=True)
    leases = Leases(client)
    started = time.perf_counter()
    copy = functools.partial(index.copy_fence, POD) if copies else None
    grant = await leases.acquire(POD, "bench", 60.0, copy=copy)
    granted = time.perf_counter() - started
    assert isinstance(grant, Grant)
    index.set_fence(POD, grant.fence)
    spent = []
    for batch in work:
        started = time.perf_counter()
        await index.apply(batch)
        spent.append(time.perf_counter() - started)
    return statistics.median(spent), granted


async def run(args: argparse.Namespace) -> None:
    versions: list[tuple[str, Callable[..., Any], bool]] = []
    if args.baseline:
        old = baseline.load(args.baseline).index
        versions.append((f"@{args.baseline}", old.redis.RedisIndex, False))
    versions.append(("today", RedisIndex, True))
    work = batches(args.batches, args.blocks_per_batch)
    per_batch: dict[str, list[float]] = {name: [] for name, _, _ in versions}
    grants: dict[str, list[float]] = {name: [] for name, _, _ in versions}
    with redis_cluster() as cluster:
        client = connect(cluster.url)
        for _, make, copies in versions:  # untimed: connections to every master, scripts
            await measure(client, make, copies, work[:CONVERSATIONS])
        for _ in range(args.repeat):
            for name, make, copies in versions:
                batch, grant = await measure(client, make, copies, work)
                per_batch[name].append(batch)
                grants[name].append(grant)
        await client.aclose()
    med = statistics.median
    print(
        f"fenced writes, 3-master Redis Cluster, {args.batches} batches x "
        f"{args.blocks_per_batch} blocks of {BLOCK} tokens, medians of {args.repeat} runs "
        f"side by side (load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores)"
    )
    print(f"  {'index':<24}{'ms per batch':>14}{'ms per grant':>14}")
    for name, _, _ in versions:
        print(f"  {name:<24}{med(per_batch[name]) * 1e3:>14.3f}{med(grants[name]) * 1e3:>14.3f}")
    if args.baseline:
        ratio = med(per_batch["today"]) / med(per_batch[f"@{args.baseline}"])
        print(f"  per batch, today / @{args.baseline}: {ratio:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=400)
    parser.add_argument("--blocks-per-batch", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--baseline", metavar="REF", help="also run the index as of git REF")
    args = parser.parse_args()
    if args.batches <= 0 or args.blocks_per_batch <= 0 or args.repeat <= 0:
        parser.error("--batches, --blocks-per-batch and --repeat must be positive")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
