"""How evenly the Redis index spreads over the masters of a Redis Cluster.

Two workloads go into a RedisIndex on a throw-away local cluster (3 masters, no
replicas): (a) the Mooncake conversation trace's prompts (bench/replay/traces, its
512-token blocks given deterministic tokens per hash id) and (b) a chat workload where
every prompt is a shared chat template, a shared 1k-token system prompt and a user turn
of its own. Each prompt is stored by one of `--pods` pods (round robin), then every
prompt is looked up once. Per master: block keys and (block, source) entries after the
stores, and the work of the lookups (reads the scripts made: HGET + HGETALL + HEXISTS, and
script time from `INFO commandstats`). The same keys tagged by the chain's first block
(layout 2, one slot per conversation) are counted beside them.

    python -m bench.redis_spread [--requests 400] [--pods 8] [--json PATH]

Goal: with 3 masters the busiest holds and serves at most 1.5x the mean.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from redis.crc import key_slot

from bench.replay.trace import read_trace
from globalkv.index.base import Source, SourceBatch, StoreBlocks, Tier
from globalkv.index.redis import RedisIndex
from globalkv.index.redis_keys import RedisKeys
from globalkv.keys import EngineHash, request_chain, root_key
from globalkv.redis_client import connect
from globalkv.stack.redis_cluster import LocalRedisCluster

BLOCK = 16
MODEL = "bench-model"
TRACE = Path(__file__).parent / "replay" / "traces" / "mooncake_conversation_trace.jsonl.xz"
TEMPLATE_TOKENS = 32
SYSTEM_TOKENS = 1024
READS = ("cmdstat_hget", "cmdstat_hgetall", "cmdstat_hexists")

Prompt = tuple[list[int], list[int]]
"""Tokens and engine hashes (one per index block) of a prompt."""


def mooncake_prompts(count: int) -> list[Prompt]:
    trace = read_trace(TRACE, limit=count)
    per = trace.block_size // BLOCK
    prompts = []
    for request in trace.requests:
        full = request.input_length // trace.block_size
        tokens: list[int] = []
        hashes: list[int] = []
        for hash_id in request.hash_ids[:full]:
            tokens += [(hash_id * 7919 + j) % 50_000 for j in range(trace.block_size)]
            hashes += [hash_id * per + j + 1 for j in range(per)]
        if hashes:
            prompts.append((tokens, hashes))
    return prompts


def chat_prompts(count: int, rng: random.Random) -> list[Prompt]:
    shared = [rng.randrange(50_000) for _ in range(TEMPLATE_TOKENS + SYSTEM_TOKENS)]
    shared_blocks = len(shared) // BLOCK
    prompts = []
    unique = 1 << 40
    for _ in range(count):
        turn = rng.randrange(256, 2049) // BLOCK * BLOCK
        tokens = shared + [rng.randrange(50_000) for _ in range(turn)]
        hashes = list(range(1, shared_blocks + 1))
        hashes += list(range(unique, unique + turn // BLOCK))
        unique += turn // BLOCK
        prompts.append((tokens, hashes))
    return prompts


async def _store(index: RedisIndex, prompts: Sequence[Prompt], pods: int) -> None:
    namespace = root_key(MODEL)
    seqs = [0] * pods
    for i, (tokens, hashes) in enumerate(prompts):
        pod = i % pods
        event = StoreBlocks(
            [EngineHash(h) for h in hashes], None, tokens, BLOCK, Tier.GPU, namespace
        )
        await index.apply(SourceBatch(Source(f"pod{pod}"), seqs[pod], 0.0, [event]))
        seqs[pod] += 1


def _masters(cluster: LocalRedisCluster) -> list[Any]:
    return [n for n in cluster.nodes if n.port in cluster.master_ports()]


def _entries(cluster: LocalRedisCluster, prefix: str) -> list[tuple[int, int]]:
    """Per master: block keys, and (block, source) entries (hash fields but "#")."""
    out = []
    for node in _masters(cluster):
        keys = entries = 0
        with node.client(timeout=30) as client:
            batch: list[bytes] = []
            for name in client.scan_iter(match=f"{RedisKeys(prefix).block_prefix}*", count=1000):
                batch.append(name)
                if len(batch) >= 1000:
                    entries += _fields(client, batch)
                    keys += len(batch)
                    batch = []
            entries += _fields(client, batch)
            keys += len(batch)
        out.append((keys, entries))
    return out


def _fields(client: Any, names: list[bytes]) -> int:
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.hlen(name)
    return sum(n - 1 for n in pipe.execute())


def _reset_stats(cluster: LocalRedisCluster) -> None:
    for node in _masters(cluster):
        with node.client() as client:
            client.config_resetstat()


def _lookup_work(cluster: LocalRedisCluster) -> list[tuple[int, float]]:
    """Per master: block reads made by scripts, and script milliseconds."""
    out = []
    for node in _masters(cluster):
        with node.client() as client:
            stats = client.info("commandstats")
        reads = sum(int(stats.get(name, {}).get("calls", 0)) for name in READS)
        usec = float(stats.get("cmdstat_evalsha", {}).get("usec", 0))
        out.append((reads, usec / 1000))
    return out


def _root_tagged(prompts: Sequence[Prompt], slots_of: list[range]) -> list[int]:
    """Per master, the distinct block keys were they tagged by the chain's root (layout 2)."""
    per = [0] * len(slots_of)
    seen: set[int] = set()
    for tokens, _ in prompts:
        chain = request_chain(tokens, BLOCK, MODEL)
        root = chain[0]
        slot = key_slot(f"{{{root:016x}}}".encode())
        master = next(i for i, r in enumerate(slots_of) if slot in r)
        for key in chain:
            if key not in seen:
                seen.add(key)
                per[master] += 1
    return per


def _ratio(values: Sequence[float]) -> float:
    mean = statistics.fmean(values)
    return max(values) / mean if mean else 0.0


async def _workload(
    name: str, prompts: list[Prompt], pods: int, cluster: LocalRedisCluster
) -> dict[str, Any]:
    client = connect(cluster.url)
    try:
        await client.flushall()
        index = RedisIndex(client, BLOCK)
        await _store(index, prompts, pods)
        entries = _entries(cluster, "gkv")
        _reset_stats(cluster)
        for tokens, _ in prompts:
            await index.lookup(request_chain(tokens, BLOCK, MODEL))
        work = _lookup_work(cluster)
    finally:
        await client.aclose()
    thirds = [range(0, 5461), range(5461, 10923), range(10923, 16384)]
    root = _root_tagged(prompts, thirds)
    return {
        "workload": name,
        "prompts": len(prompts),
        "blocks_per_prompt": statistics.fmean(len(h) for _, h in prompts),
        "keys": [k for k, _ in entries],
        "entries": [e for _, e in entries],
        "reads": [r for r, _ in work],
        "script_ms": [round(ms, 1) for _, ms in work],
        "root_tagged_keys": root,
        "ratio_keys": _ratio([k for k, _ in entries]),
        "ratio_entries": _ratio([e for _, e in entries]),
        "ratio_reads": _ratio([r for r, _ in work]),
        "ratio_script_ms": _ratio([ms for _, ms in work]),
        "ratio_root_tagged_keys": _ratio(root),
    }


def _print(row: dict[str, Any]) -> None:
    print(
        f"{row['workload']}: {row['prompts']} prompts, "
        f"{row['blocks_per_prompt']:.0f} blocks each; busiest master / mean "
        f"(per master values):"
    )
    for what in ("keys", "entries", "reads", "script_ms", "root_tagged_keys"):
        print(f"  {what:18} {row['ratio_' + what]:.2f}x  {row[what]}")


async def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.redis_spread", description=__doc__)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--pods", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    cluster = LocalRedisCluster(masters=3, replicas=0)
    cluster.start()
    try:
        rows = [
            await _workload("mooncake", mooncake_prompts(args.requests), args.pods, cluster),
            await _workload(
                "chat", chat_prompts(args.requests, random.Random(7)), args.pods, cluster
            ),
        ]
    finally:
        cluster.stop()
    for row in rows:
        _print(row)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    worst = max(row[f"ratio_{w}"] for row in rows for w in ("entries", "reads", "script_ms"))
    return 0 if worst <= 1.5 else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
