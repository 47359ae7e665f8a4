"""One lookup in Redis: the chain's segments walked by one script per master, then joined.

Round trips: on one Redis, one pipeline (the script over the whole chain, then `HGETALL`
of the live generations). On a cluster, one script per master holding a segment of the
chain and the live read on the master of the index's own slot, all concurrently: at most
the number of masters plus one calls, however long the chain. A script walks adjacent
segments of its master as one stretch, so on one Redis the walk is the single-slot walk
it always was.

Which sources count is decided by that one read of the live generations (one key, on one
master, so no shard can disagree about a source's epoch): a generation is only ever
retired, never revived, and a retired generation is never written again, so every block
the walks find of a generation live at that read is one its source held while live. A
source reset or removed before the lookup began is never reported, whatever shard its
blocks are on and however far their dropping got; a lookup that overlaps a reset answers
as if it ran just before it. On one Redis the live read runs after the walk, in the same
pipeline, so even an overlapping reset is seen.

Joining keeps the contiguous-prefix semantics: segment i of a generation counts only if
the generation held every block of segments 0..i-1; a script reports, per stretch, the
run of each generation from the stretch's first block.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from functools import lru_cache
from typing import Any, NamedTuple

from globalkv.index.base import Hit, Source
from globalkv.index.redis_keys import RedisKeys, Segment, parse_source_name
from globalkv.index.redis_scripts import LOOKUP
from globalkv.index.redis_shards import Shards
from globalkv.index.scoring import TierWeights, make_hit, ranked
from globalkv.keys import BlockKey

Rows = list[int]
"""A segment's rows from the script: generation, n, n x (mask, blocks), ..."""


class Stretch(NamedTuple):
    """Adjacent segments of a chain on one master: one walk of the lookup script."""

    start: int
    length: int
    segments: list[Segment]


async def lookup(
    client: Any, shards: Shards, names: RedisKeys, keys: Sequence[BlockKey], weights: TierWeights
) -> list[Hit]:
    """The hits of a chain (`keys[0]` its root), best first. Redis errors pass through."""
    segments = names.segments(keys)
    groups = [_stretches(g) for g in shards.group([s.slot for s in segments], segments)]
    if shards.cluster is None:
        pipe = client.pipeline(transaction=False)
        pipe.evalsha(LOOKUP.sha, 1, _route(groups[0]), *_argv(groups[0]))
        pipe.hgetall(names.live)
        walked, live = await pipe.execute()
        replies = [walked]
    else:
        *replies, live = await asyncio.gather(
            *(_walk(client, group) for group in groups), client.hgetall(names.live)
        )
    rows: dict[int, Rows] = {}
    stretches: list[Stretch] = []
    for group, walked in zip(groups, replies, strict=True):
        rows.update(zip((s.start for s in group), walked, strict=False))
        stretches += group
    stretches.sort(key=lambda s: s.start)
    return _hits(stretches, rows, live, weights)


def _stretches(segments: list[Segment]) -> list[Stretch]:
    """One master's segments (in chain order) as runs of adjacent ones."""
    out: list[Stretch] = []
    for segment in segments:
        last = out[-1] if out else None
        if last is not None and last.start + last.length == segment.start:
            last.segments.append(segment)
            out[-1] = last._replace(length=last.length + segment.length)
        else:
            out.append(Stretch(segment.start, segment.length, [segment]))
    return out


async def _walk(client: Any, group: list[Stretch]) -> list[Rows]:
    result: list[Rows] = await LOOKUP.run(client, (_route(group),), _argv(group))
    return result


def _route(group: list[Stretch]) -> str:
    first = group[0].segments[0]
    return first.head + first.digits[:16]


def _argv(group: list[Stretch]) -> list[Any]:
    argv: list[Any] = []
    for stretch in group:
        argv.append(len(stretch.segments))
        for segment in stretch.segments:
            argv += (segment.head, segment.digits)
    return argv


def _hits(
    stretches: Sequence[Stretch],
    rows: dict[int, Rows],
    live: dict[bytes, bytes],
    weights: TierWeights,
) -> list[Hit]:
    """Hits of the live generations, joining the stretches in chain order."""
    counts: dict[int, dict[int, int]] = {}
    running: set[int] | None = None
    for stretch in stretches:
        found = rows.get(stretch.start)
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
                if total == stretch.length:
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
