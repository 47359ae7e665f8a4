"""Builders for index events, so tests read as what an engine did."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import count

from globalkv.index.base import (
    ApplyResult,
    ClearSource,
    Hit,
    Index,
    IndexEvent,
    RemoveBlocks,
    Source,
    SourceBatch,
    StoreBlocks,
    Tier,
)
from globalkv.keys import BlockKey, EngineHash, chain_keys, root_key

BS = 4
"""Index block size of the tests."""
NS = root_key("m")
P0 = Source("p0")
P1 = Source("p1")
P0_DP1 = Source("p0", 1)


def tokens(blocks: int, start: int = 0) -> list[int]:
    """Distinct tokens for `blocks` index blocks."""
    return list(range(start, start + blocks * BS))


def store(
    hashes: Sequence[int],
    token_ids: Sequence[int],
    *,
    parent: int | None = None,
    block_size: int = BS,
    tier: Tier = Tier.GPU,
    namespace: BlockKey = NS,
) -> StoreBlocks:
    return StoreBlocks(
        hashes=[EngineHash(h) for h in hashes],
        parent=None if parent is None else EngineHash(parent),
        token_ids=list(token_ids),
        block_size=block_size,
        tier=tier,
        namespace=namespace,
    )


def remove(hashes: Sequence[int], tier: Tier = Tier.GPU) -> RemoveBlocks:
    return RemoveBlocks([EngineHash(h) for h in hashes], tier)


def clear() -> ClearSource:
    return ClearSource()


def keys(token_ids: Sequence[int], namespace: BlockKey = NS) -> list[BlockKey]:
    return chain_keys(namespace, token_ids, BS)


class Feeder:
    """Applies events per source with increasing seq, as ingest does."""

    def __init__(self, index: Index) -> None:
        self.index = index
        self._seqs: dict[Source, count[int]] = {}

    async def __call__(self, source: Source, *events: IndexEvent, ts: float = 1.0) -> ApplyResult:
        seq = next(self._seqs.setdefault(source, count()))
        return await self.index.apply(SourceBatch(source, seq, ts, list(events)))


def depths(hits: Sequence[Hit]) -> dict[Source, int]:
    return {h.source: h.blocks for h in hits}


def scores(hits: Sequence[Hit]) -> dict[Source, float]:
    return {h.source: h.score for h in hits}
