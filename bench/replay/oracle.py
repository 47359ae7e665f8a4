"""Reference hit rates that no routing policy can beat, for the same trace and capacity.

Under the engine's rules only whole blocks are cached and a request can hit block i only
if i < (input_length - 1) // B (the last prompt token is always computed). Each request
therefore *references* its whole blocks in order, of which the first `hittable` can hit.

- `unlimited`: a cache that never evicts: every whole block seen before hits.
- `pooled_lru`: one `PagedKVCache` with the cluster's total capacity, fed the trace in
  order: what a perfectly shared cache with the engine's own LRU leaf eviction reaches.
  It works on block ids as one-"token" pages: equal ids are equal prefixes.
- `belady`: Belady's MIN with bypass over the block reference string and the same total
  capacity, counting hits on every reference (hittable or not). Pods of that total
  capacity hold at most that many distinct blocks, and a hit needs the block present
  somewhere, so a routing whose pods admit a block when a request referencing it arrives
  cannot exceed this; contiguity is not even required of it. (The engine admits a
  prompt's blocks when its prefill ends, holding them meanwhile outside the capacity;
  in theory that lag can beat MIN on adversarial strings. The unlimited line bounds
  everything.)

Token rates weigh each hit by the block size over all input tokens (every hittable block
is whole, so this is exact).

`ttft_floor_s` is the mean TTFT no routing can beat on the simulated pods: each request
served at once (no queue) with the longest prefix an unlimited cache could hold, paying
the overhead, the prefill of the rest (with the attention term when modelled) and the
KV transfer. The slowest policy's TTFT over it bounds every TTFT ratio.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from bench.replay.config import ResolvedCluster
from bench.replay.trace import Trace
from enginesim.kvcache import PagedKVCache

_NEVER = 1 << 62
_PAST_PROMPT = -1
"""An id no trace uses, appended so `match` may hit every hittable block (see below)."""


@dataclass(frozen=True, slots=True)
class OracleLines:
    capacity_blocks: int
    unlimited: float
    pooled_lru: float
    belady: float
    ttft_floor_s: float


def _references(trace: Trace) -> tuple[list[int], list[bool]]:
    bs = trace.block_size
    blocks: list[int] = []
    hittable: list[bool] = []
    for req in trace.requests:
        can_hit = (req.input_length - 1) // bs
        for i in range(req.input_length // bs):
            blocks.append(req.hash_ids[i])
            hittable.append(i < can_hit)
    return blocks, hittable


def _input_tokens(trace: Trace) -> int:
    return sum(r.input_length for r in trace.requests)


def unlimited(trace: Trace) -> float:
    seen: set[int] = set()
    hits = 0
    for block, can_hit in zip(*_references(trace), strict=True):
        if block in seen:
            hits += can_hit
        else:
            seen.add(block)
    return hits * trace.block_size / _input_tokens(trace)


def pooled_lru(trace: Trace, capacity: int) -> float:
    """The engine's cache, one page per block id, `capacity` blocks for the whole cluster.

    `match` never serves a prompt's last token, so the hittable ids are followed by one
    sentinel id: the cache may then hit all of them and none beyond.
    """
    cache = PagedKVCache(1, capacity)
    bs = trace.block_size
    hits = 0
    for req in trace.requests:
        can_hit = (req.input_length - 1) // bs
        match = cache.match([*req.hash_ids[:can_hit], _PAST_PROMPT])
        hits += match.cached_tokens
        cache.release(match)
        cache.insert(req.hash_ids[: req.input_length // bs])
    return hits * bs / _input_tokens(trace)


def belady(trace: Trace, capacity: int) -> float:
    blocks, _ = _references(trace)
    next_use = [0] * len(blocks)
    upcoming: dict[int, int] = {}
    for i in range(len(blocks) - 1, -1, -1):
        next_use[i] = upcoming.get(blocks[i], _NEVER)
        upcoming[blocks[i]] = i
    cached: dict[int, int] = {}
    """block -> its next use; the heap holds (-next use, block), stale entries skipped."""
    heap: list[tuple[int, int]] = []
    hits = 0
    for i, block in enumerate(blocks):
        nxt = next_use[i]
        if block in cached:
            hits += 1
            if nxt == _NEVER:
                del cached[block]
            else:
                cached[block] = nxt
                heapq.heappush(heap, (-nxt, block))
            continue
        if nxt == _NEVER:
            continue
        if len(cached) >= capacity:
            while cached.get(heap[0][1]) != -heap[0][0]:
                heapq.heappop(heap)
            if -heap[0][0] <= nxt:
                continue
            _, evicted = heapq.heappop(heap)
            del cached[evicted]
        cached[block] = nxt
        heapq.heappush(heap, (-nxt, block))
    return hits * trace.block_size / _input_tokens(trace)


def _prefill_work(start: int, end: int, attention_tokens: float | None) -> float:
    """Linear-token units of computing positions [start, end) (see bench.replay.pods)."""
    work = float(end - start)
    if attention_tokens is not None:
        work += (end * (end - 1) - start * (start - 1)) / (2 * attention_tokens)
    return work


def ttft_floor(trace: Trace, cluster: ResolvedCluster) -> float:
    bs = trace.block_size
    seen: set[int] = set()
    total = 0.0
    for req in trace.requests:
        length = req.input_length
        cached = 0
        for i in range((length - 1) // bs):
            if req.hash_ids[i] not in seen:
                break
            cached += bs
        seen.update(req.hash_ids[: length // bs])
        work = _prefill_work(cached, length, cluster.attention_tokens)
        total += cluster.prefill_overhead_s + work / cluster.prefill_tokens_per_s
        if cluster.kv_transfer_tokens_per_s is not None:
            total += length / cluster.kv_transfer_tokens_per_s
    return total / len(trace.requests)


def oracle_lines(trace: Trace, cluster: ResolvedCluster) -> OracleLines:
    """The lines for the cluster's total capacity (pods × blocks per pod)."""
    capacity = cluster.capacity_blocks * cluster.pods
    return OracleLines(
        capacity_blocks=capacity,
        unlimited=unlimited(trace),
        pooled_lru=pooled_lru(trace, capacity),
        belady=belady(trace, capacity),
        ttft_floor_s=ttft_floor(trace, cluster),
    )
