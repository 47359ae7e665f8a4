"""One lookup in Redis: the chain's segments walked by one script per master, then joined.

Round trips: on one Redis, one script call (the walk over the whole chain, then `HGETALL`
of the live generations, in the same script). On a cluster, one script per master holding
a segment of the chain, all concurrently; the script on the master of the index's own
slot also reads the live generations after its walk (a separate read, concurrent with the
walks, only when no segment is there): at most the number of masters plus one calls,
however long the chain. A script walks all of its master's segments as one run of blocks,
so on one Redis the walk is the single-slot walk it always was.

Which sources count is decided by that one read of the live generations (one key, on one
master, so no shard can disagree about a source's epoch): a generation is only ever
retired, never revived, and a retired generation is never written again, so every block
the walks find of a generation live at that read is one its source held while live. A
source reset or removed before the lookup began is never reported, whatever shard its
blocks are on and however far their dropping got; a lookup that overlaps a reset answers
as if it ran just before it. On one Redis the live read runs after the walk, in the same
script, so even an overlapping reset is seen.

Joining keeps the contiguous-prefix semantics: a master reports, per generation holding
its first segment's first block, how many of its segments' blocks that generation holds
contiguously (across the other masters' segments between them); the generation's depth
is where the first of those runs ends in chain order, and only generations holding the
chain's first block count.

While a slot migrates (a reshard), a lookup is right, shorter or unavailable, never deeper
and never another pod: docs/redis-cluster.md ("Resharding") says why.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from functools import lru_cache
from itertools import accumulate
from typing import Any

from redis.crc import key_slot

from globalkv.index.base import Hit, Source
from globalkv.index.redis_keys import RedisKeys, Segment, parse_source_name
from globalkv.index.redis_scripts import LOOKUP
from globalkv.index.redis_shards import Shards, SlotMoved
from globalkv.index.scoring import TierWeights, make_hit, ranked
from globalkv.keys import BlockKey

Rows = list[int]
"""A walk's rows from the script: generation, n, n x (mask, blocks), ..."""
_UNBOUNDED = 1 << 62


class Walk:
    """One master's segments of a chain (in chain order) and, once walked, its runs."""

    __slots__ = ("lengths", "offsets", "runs", "segments", "starts", "total")

    def __init__(self, segments: list[Segment]) -> None:
        self.segments = segments
        self.starts = [s.start for s in segments]
        self.lengths = [s.length for s in segments]
        self.offsets = list(accumulate(self.lengths, initial=0))
        self.total = self.offsets.pop()
        self.runs: dict[int, tuple[int, int, Rows | None]] = {}
        """generation -> (blocks held from the walk's first, their tier mask if they have
        one, else 0 and their flat (mask, blocks) pairs)"""

    def parse(self, rows: Rows) -> None:
        i, end = 0, len(rows)
        while i < end:
            n = rows[i + 1]
            if n == 1:  # most runs: one tier mask
                self.runs[rows[i]] = (rows[i + 3], rows[i + 2], None)
            else:
                pairs = rows[i + 2 : i + 2 + 2 * n]
                self.runs[rows[i]] = (sum(pairs[1::2]), 0, pairs)
            i += 2 + 2 * n

    def end(self, held: int) -> int:
        """Where in the chain a run of `held` blocks from this walk's first ends
        (`_UNBOUNDED`: past the walk's last)."""
        if held >= self.total:
            return _UNBOUNDED
        j = bisect_right(self.offsets, held) - 1
        return self.starts[j] + held - self.offsets[j]

    def within(self, depth: int) -> int:
        """How many of this walk's blocks lie before chain position `depth`."""
        j = bisect_right(self.starts, depth - 1) - 1
        if j < 0:
            return 0
        return self.offsets[j] + min(depth - self.starts[j], self.lengths[j])


async def lookup(
    client: Any, shards: Shards, names: RedisKeys, keys: Sequence[BlockKey], weights: TierWeights
) -> list[Hit]:
    """The hits of a chain (`keys[0]` its root), best first. Redis errors pass through.

    A slot moved since the grouping (`SlotMoved`) costs one more attempt, grouped by the
    refreshed slot map, so a completed move is never seen by callers."""
    try:
        return await _lookup(client, shards, names, keys, weights)
    except SlotMoved as exc:
        if not exc.regroup:
            raise
    return await _lookup(client, shards, names, keys, weights)


async def _lookup(
    client: Any, shards: Shards, names: RedisKeys, keys: Sequence[BlockKey], weights: TierWeights
) -> list[Hit]:
    segments = names.segments(keys)
    by_node = shards.by_node([s.slot for s in segments], segments)
    home = shards.node_of(_slot(names.live))
    walks = {node: Walk(group) for node, group in by_node.items()}
    calls = [_walk(client, w, names.live if node == home else "") for node, w in walks.items()]
    if home not in walks:
        calls.append(client.hgetall(names.live))
    replies: list[Any] = await shards.gather(*calls)
    for walk, reply in zip(walks.values(), replies, strict=False):
        walk.parse(reply[0])
    if home in walks:
        flat = replies[list(walks).index(home)][1]
        live: dict[bytes, bytes] = dict(zip(flat[::2], flat[1::2], strict=True))
    else:
        live = replies[-1]
    return _hits(sorted(walks.values(), key=lambda w: w.starts[0]), live, weights)


async def _walk(client: Any, walk: Walk, live: str) -> list[Any]:
    first = walk.segments[0]
    argv: list[Any] = [live]
    for segment in walk.segments:
        argv += (segment.head, segment.digits)
    result: list[Any] = await LOOKUP.run(client, (first.head + first.digits[:16],), argv)
    return result


@lru_cache(maxsize=64)
def _slot(name: str) -> int:
    return key_slot(name.encode())


def _hits(walks: Sequence[Walk], live: dict[bytes, bytes], weights: TierWeights) -> list[Hit]:
    """Hits of the live generations holding the chain's first block, by contiguous depth.

    Most generations hold their whole run under one tier mask: every block before their
    depth is then theirs under it, and the per-walk counting of `_mixed` is skipped (it
    was most of a 64-pod lookup's Python time on a cluster)."""
    by_mask = weights.by_mask
    hits = []
    for gen in walks[0].runs:  # walks[0] holds the chain's first segment
        name = live.get(b"%d" % gen)  # a generation not live is a retired source
        if name is None:
            continue
        depth, mask = _UNBOUNDED, -1  # mask: the one mask of every run so far, else 0
        for walk in walks:  # by first block: a walk starting at `depth` or later adds none
            if depth <= walk.starts[0]:
                break
            run = walk.runs.get(gen)
            if run is None:  # it does not hold this walk's first block
                end = walk.starts[0]
            else:
                one = run[1]
                mask = one if one and mask in (-1, one) else 0
                end = walk.end(run[0])
            if end < depth:
                depth = end
        if depth == _UNBOUNDED:
            depth = sum(walk.total for walk in walks)
        if mask > 0:
            hits.append(Hit(source_of(name), depth, by_mask[mask] * depth))
        else:
            hits.append(make_hit(source_of(name), _mixed(walks, gen, depth), weights))
    return ranked(hits)


def _mixed(walks: Sequence[Walk], gen: int, depth: int) -> dict[int, int]:
    """Blocks `gen` holds before `depth`, per tier mask."""
    held: dict[int, int] = {}
    for walk in walks:
        run = walk.runs.get(gen)
        if run is None:
            continue
        left, pairs = walk.within(depth), run[2] or [run[1], run[0]]
        for j in range(0, len(pairs), 2):
            if left <= 0:
                break
            blocks = min(pairs[j + 1], left)
            held[pairs[j]] = held.get(pairs[j], 0) + blocks
            left -= blocks
    return held


@lru_cache(maxsize=4096)
def source_of(name: bytes) -> Source:
    """Sources by their live-hash name: a lookup meets the same few every time."""
    return parse_source_name(name.decode())
