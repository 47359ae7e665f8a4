"""Joining the masters' walks of a cluster lookup (`redis_reads._hits`) against the
contiguous-prefix semantics computed block by block, for random holders and tiers."""

from __future__ import annotations

import random

import pytest

from globalkv.index.base import Hit, Source, Tier
from globalkv.index.redis_keys import Segment
from globalkv.index.redis_reads import Walk, _hits
from globalkv.index.scoring import TierWeights, make_hit, ranked

WEIGHTS = TierWeights({Tier.CPU: 0.5, Tier.DISK: 0.25})


def _rows(walk: Walk, masks: dict[int, list[int]]) -> list[int]:
    """What the lookup script returns for `walk`: per generation holding its first block,
    its runs of equal masks over the walk's blocks until the first it lacks."""
    blocks = [b for s in walk.segments for b in range(s.start, s.start + s.length)]
    rows: list[int] = []
    for gen, per_block in masks.items():
        if not per_block[blocks[0]]:
            continue
        pairs: list[int] = []
        for b in blocks:
            mask = per_block[b]
            if not mask:
                break
            if pairs and pairs[-2] == mask:
                pairs[-1] += 1
            else:
                pairs += [mask, 1]
        rows += [gen, len(pairs) // 2, *pairs]
    return rows


def _expected(masks: dict[int, list[int]]) -> list[Hit]:
    hits = []
    for gen, per_block in masks.items():
        held: dict[int, int] = {}
        for mask in per_block:
            if not mask:
                break
            held[mask] = held.get(mask, 0) + 1
        if held:
            hits.append(make_hit(Source(f"g{gen}"), held, WEIGHTS))
    return ranked(hits)


@pytest.mark.parametrize("seed", range(300))
def test_joined_walks_give_each_generation_its_contiguous_depth_and_tiers(seed: int) -> None:
    rng = random.Random(seed)
    lengths = [16] * rng.randint(1, 16) + [128] * rng.randint(0, 2)
    lengths[-1] = rng.randint(1, lengths[-1])  # a prompt ends inside a segment
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    blocks = sum(lengths)
    masters = rng.randint(1, 4)
    by_master: dict[int, list[Segment]] = {}
    for i, (start, length) in enumerate(zip(starts, lengths, strict=True)):
        segment = Segment(i, "", "", start, length)
        by_master.setdefault(rng.randrange(masters), []).append(segment)
    masks: dict[int, list[int]] = {}
    for gen in range(1, rng.randint(1, 12) + 1):
        depth = rng.choice([blocks, rng.randint(0, blocks)])
        tiers = rng.choice([[1], [1], [1, 2], [1, 2, 4, 3]])
        per_block = [rng.choice(tiers) if b < depth else 0 for b in range(blocks)]
        for b in range(depth, blocks):  # held again after a gap: must not count
            per_block[b] = rng.choice([0, 0, 1])
        masks[gen] = per_block
    walks = sorted((Walk(group) for group in by_master.values()), key=lambda w: w.starts[0])
    for walk in walks:
        walk.parse(_rows(walk, masks))
    live = {b"%d" % gen: f"g{gen}@0".encode() for gen in masks}
    assert _hits(walks, live, WEIGHTS) == _expected(masks)
