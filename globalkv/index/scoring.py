"""Tier-weighted scores and hit order, shared so that equal state ranks equally everywhere.

A source's score for a looked-up chain is the sum, over its contiguous hit blocks, of the
weight of the best tier it holds each block in (GPU 1.0, CPU 0.8, disk 0.5 by default):
a block that must first come back from disk is worth less than one already on the GPU.
Backends report, per source, how many hit blocks it holds under each tier mask; the score
is computed here, in one fixed order, so both backends return bit-identical floats.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from operator import attrgetter

from globalkv.index.base import DEFAULT_TIER_WEIGHTS, Hit, Source, Tier

ALL_TIERS = sum(int(t) for t in Tier)


class TierWeights:
    """Validated weights, precomputed per tier mask (the best tier held wins)."""

    __slots__ = ("by_mask",)

    def __init__(self, weights: Mapping[Tier, float] | None = None) -> None:
        merged = dict(DEFAULT_TIER_WEIGHTS)
        for tier, weight in (weights or {}).items():
            if not isinstance(tier, Tier):
                raise ValueError(f"tier weights are keyed by Tier, got {tier!r}")
            if not isinstance(weight, int | float) or not math.isfinite(weight) or weight < 0:
                raise ValueError(f"weight of {tier.name} must be a finite number >= 0")
            merged[tier] = float(weight)
        self.by_mask: tuple[float, ...] = (
            0.0,
            *(max(merged[t] for t in Tier if mask & t) for mask in range(1, ALL_TIERS + 1)),
        )
        """Index: a tier mask; value: the weight of a block held in those tiers."""

    def score(self, blocks_by_mask: Mapping[int, int]) -> float:
        by_mask = self.by_mask
        return sum(by_mask[mask] * blocks_by_mask[mask] for mask in sorted(blocks_by_mask))


source_order = attrgetter("pod", "dp_rank")
"""`Source`'s own order as a tuple of str and int: sorting many sources by it stays in C
(the dataclass's generated __lt__ builds two tuples in Python per comparison)."""


def ranked(hits: Iterable[Hit]) -> list[Hit]:
    """Best first: score, then depth, then source for a stable order.

    Two stable sorts with C-level keys (source, then score and depth descending) instead of
    one with a key tuple built in Python per hit.
    """
    order = sorted(hits, key=_by_source)
    order.sort(key=_by_score_and_depth, reverse=True)
    return order


_by_source = attrgetter("source.pod", "source.dp_rank")
_by_score_and_depth = attrgetter("score", "blocks")


def make_hit(source: Source, blocks_by_mask: Mapping[int, int], weights: TierWeights) -> Hit:
    return Hit(source, sum(blocks_by_mask.values()), weights.score(blocks_by_mask))
