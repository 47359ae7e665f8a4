"""One lookup in Redis: the chain's segments walked by one script per master, then joined.

Round trips: on one Redis, one pipeline (the script over every segment, then `HGETALL`
of the live generations: Redis runs them in that order). On a cluster, one script per
master holding a segment of the chain, concurrently (at most the number of masters,
however long the chain), then the live read on the master of the index's own slot.

The live read comes after the walks, on purpose: generations are only ever retired, never
revived, so a generation still live after the walk was live during it, and what the walk
saw of it was what its source held while it was live. A reset or removed source is never
reported, whatever shard its blocks are on and however far their dropping got.

Joining keeps the contiguous-prefix semantics: segment i of a generation counts only if
the generation held every block of segments 0..i-1; a script reports, per segment, the
run of each generation from the segment's first block.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from globalkv.index.base import Hit, Source
from globalkv.index.redis_keys import RedisKeys, Segment, parse_source_name
from globalkv.index.redis_scripts import LOOKUP
from globalkv.index.redis_shards import Shards
from globalkv.index.scoring import TierWeights, make_hit, ranked
from globalkv.keys import BlockKey

Rows = list[int]
"""A segment's rows from the script: generation, n, n x (mask, blocks), ..."""


async def lookup(
    client: Any, shards: Shards, names: RedisKeys, keys: Sequence[BlockKey], weights: TierWeights
) -> list[Hit]:
    """The hits of a chain (`keys[0]` its root), best first. Redis errors pass through."""
    segments = names.segments(keys)
    if shards.cluster is None:
        pipe = client.pipeline(transaction=False)
        pipe.evalsha(LOOKUP.sha, 1, _route(segments[0]), *_argv(segments))
        pipe.hgetall(names.live)
        walked, live = await pipe.execute()
        rows = dict(zip((s.start for s in segments), walked, strict=False))
    else:
        groups = shards.group([s.slot for s in segments], segments)
        replies = await asyncio.gather(*(_walk(client, group) for group in groups))
        live = await client.hgetall(names.live)
        rows = {}
        for group, walked in zip(groups, replies, strict=True):
            rows.update(zip((s.start for s in group), walked, strict=False))
    return _hits(segments, rows, live, weights)


async def _walk(client: Any, group: list[Segment]) -> list[Rows]:
    result: list[Rows] = await LOOKUP.run(client, (_route(group[0]),), _argv(group))
    return result


def _route(segment: Segment) -> str:
    return segment.head + segment.digits[:16]


def _argv(segments: Sequence[Segment]) -> list[str]:
    return [x for s in segments for x in (s.head, s.digits)]


def _hits(
    segments: Sequence[Segment],
    rows: dict[int, Rows],
    live: dict[bytes, bytes],
    weights: TierWeights,
) -> list[Hit]:
    """Hits of the live generations, joining the segments in order."""
    counts: dict[int, dict[int, int]] = {}
    running: set[int] | None = None
    for segment in segments:
        found = rows.get(segment.start)
        if not found:
            break
        following: set[int] = set()
        i, end = 0, len(found)
        while i < end:
            gen, pairs = found[i], found[i + 1]
            if running is None or gen in running:
                held = counts.setdefault(gen, {})
                total = 0
                for j in range(i + 2, i + 2 + 2 * pairs, 2):
                    held[found[j]] = held.get(found[j], 0) + found[j + 1]
                    total += found[j + 1]
                if total == segment.length:
                    following.add(gen)
            i += 2 + 2 * pairs
        running = following
        if not running:
            break
    by_mask = weights.by_mask
    hits = []
    for gen, held in counts.items():
        name = live.get(b"%d" % gen)  # a generation not live is a retired source
        if name is None:
            continue
        if len(held) == 1:  # one tier mask all the way: no scoring over masks
            [(mask, blocks)] = held.items()
            hits.append(Hit(source_of(name), blocks, by_mask[mask] * blocks))
        else:
            hits.append(make_hit(source_of(name), held, weights))
    return ranked(hits)


@lru_cache(maxsize=4096)
def source_of(name: bytes) -> Source:
    """Sources by their live-hash name: a lookup meets the same few every time."""
    return parse_source_name(name.decode())
