"""Any sequence of batches, resets, pod removals and writer restarts leaves every backend
equal to a reference model written from the definitions, with no shared code.

The model names an index block by its whole token path from the namespace root (what our
chained key stands for), keeps each source's engine blocks as lists of such paths, and
answers lookups by brute force. Small alphabets and hash pools make collisions, aliases,
re-stores and orphans common.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import fakeredis
import pytest
import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st

from globalkv.index.base import (
    DEFAULT_TIER_WEIGHTS,
    ApplyResult,
    ClearSource,
    Index,
    IndexEvent,
    RemoveBlocks,
    Source,
    SourceBatch,
    StoreBlocks,
    Tier,
)
from globalkv.index.memory import MemoryIndex
from globalkv.index.redis import RedisIndex
from globalkv.index.redis_scripts import fingerprints
from globalkv.keys import BlockKey, EngineHash, chain_keys, root_key
from tests.support.redis import RedisServer

BS = 2
NAMESPACES = (root_key("m"), root_key("m", "lora"))
SOURCES = (Source("p0"), Source("p0", 1), Source("p1"))

T = TypeVar("T")
Path = tuple[int, ...]
"""(namespace, token, token, ...): an index block named by everything before it."""


@dataclass
class Model:
    blocks: dict[Source, dict[int, tuple[list[Path], int]]] = field(default_factory=dict)

    def apply(self, source: Source, events: Sequence[IndexEvent]) -> ApplyResult:
        result = ApplyResult()
        held = self.blocks.setdefault(source, {})
        for event in events:
            if isinstance(event, ClearSource):
                held.clear()
                result.cleared += 1
            elif isinstance(event, RemoveBlocks):
                for h in event.hashes:
                    if h in held and held[h][1] & event.tier:
                        paths, tiers = held[h]
                        result.removed += 1
                        if tiers & ~event.tier:
                            held[h] = (paths, tiers & ~event.tier)
                        else:
                            del held[h]
            elif isinstance(event, StoreBlocks):
                self._store(held, event, result)
        return result

    def _store(
        self, held: dict[int, tuple[list[Path], int]], event: StoreBlocks, result: ApplyResult
    ) -> None:
        n, size = len(event.hashes), event.block_size
        if size <= 0 or size % BS or len(event.token_ids) != n * size:
            result.partial += n
            return
        if event.parent is None:
            base: Path = (event.namespace,)
        elif event.parent in held:
            base = held[event.parent][0][-1]
        else:
            result.orphans += n
            return
        for j, h in enumerate(event.hashes):
            result.stored += 1
            if h in held:
                paths, tiers = held[h]
                held[h] = (paths, tiers | event.tier)
                base = paths[-1]
                continue
            tokens = event.token_ids[j * size : (j + 1) * size]
            paths = [base + tuple(tokens[: (i + 1) * BS]) for i in range(size // BS)]
            held[h] = (paths, int(event.tier))
            base = paths[-1]

    def tiers(self, source: Source, path: Path) -> int:
        mask = 0
        for paths, tiers in self.blocks.get(source, {}).values():
            if path in paths:
                mask |= tiers
        return mask

    def lookup(self, path: Path) -> dict[Source, tuple[int, float]]:
        hits = {}
        for source in self.blocks:
            depth, score = 0, 0.0
            for end in range(1 + BS, len(path) + 1, BS):
                mask = self.tiers(source, path[:end])
                if not mask:
                    break
                depth += 1
                score += max(DEFAULT_TIER_WEIGHTS[t] for t in Tier if mask & t)
            if depth:
                hits[source] = (depth, score)
        return hits

    def held_paths(self) -> set[Path]:
        return {p for held in self.blocks.values() for paths, _ in held.values() for p in paths}


@dataclass(frozen=True)
class Batch:
    source: Source
    events: tuple[IndexEvent | Placeholder, ...]


@dataclass(frozen=True)
class Reset:
    source: Source


@dataclass(frozen=True)
class RemovePod:
    pod: str


@dataclass(frozen=True)
class Restart:
    """A new writer process on the same Redis (nothing for the memory backend)."""


DOCS = ((0, 1) * 8, (0, 1, 1, 0) * 4, (1, 1, 0, 0) * 4)
"""Prompts engines cache: shared beginnings, so sources hold overlapping chains."""
tiers = st.sampled_from(list(Tier))


def engine_hash(namespace: int, prefix: Sequence[int], size: int, salt: int) -> EngineHash:
    """Like an engine's: a function of the whole prefix (salt: extra keys we cannot see)."""
    return EngineHash(hash((namespace, tuple(prefix), size, salt)) & 0xFFFF_FFFF)


@dataclass(frozen=True)
class DocRun:
    """Engine blocks [first, first + count) of a document, stored as an engine would."""

    doc: int
    size: int
    first: int
    count: int
    salt: int
    namespace: int
    tier: Tier
    noise: str = "none"

    def event(self) -> StoreBlocks | None:
        doc, size = DOCS[self.doc], self.size
        count = min(self.count, len(doc) // size - self.first)
        if count <= 0:
            return None
        ns, salt, first = self.namespace, self.salt, self.first
        hashes = [engine_hash(ns, doc[: (first + k + 1) * size], size, salt) for k in range(count)]
        parent = engine_hash(ns, doc[: first * size], size, salt) if first else None
        token_ids = list(doc[first * size : (first + count) * size])
        if self.noise == "random parent":
            parent = EngineHash(first)
        elif self.noise == "nil parent":
            parent = None
        elif self.noise == "bad length":
            token_ids = token_ids[:-1]
        return StoreBlocks(hashes, parent, token_ids, size, self.tier, ns)


@dataclass(frozen=True)
class Extend:
    """The next engine blocks after the source's latest run."""

    count: int
    tier: Tier


@dataclass(frozen=True)
class RemoveRecent:
    """Removes of hashes the source stored lately (`back` counts from the latest); with no
    tier, from the tier they were stored in."""

    back: tuple[int, ...]
    tier: Tier | None


@dataclass(frozen=True)
class StoreAgain:
    """A store the source made earlier, again: in some tier, or (alias) under other engine
    hashes for the same tokens."""

    back: int
    alias: bool
    tier: Tier


runs = st.builds(
    DocRun,
    doc=st.integers(0, len(DOCS) - 1),
    size=st.sampled_from([2] * 5 + [4] * 4 + [3]),
    first=st.sampled_from([0] * 6 + [1, 2]),
    count=st.integers(1, 4),
    salt=st.sampled_from([0, 0, 0, 1]),
    namespace=st.sampled_from(NAMESPACES),
    tier=tiers,
    noise=st.sampled_from(["none"] * 12 + ["random parent", "nil parent", "bad length"]),
)
extends = st.builds(Extend, st.integers(1, 3), tiers)
removes = st.builds(
    RemoveRecent,
    st.lists(st.integers(0, 6), min_size=1, max_size=3).map(tuple),
    st.sampled_from([None, None, None, *Tier]),
)
stores_again = st.builds(StoreAgain, st.integers(0, 4), st.booleans(), tiers)


def weighted(*choices: tuple[int, st.SearchStrategy[T]]) -> st.SearchStrategy[T]:
    """`one_of` with weights (it would pick its branches about evenly)."""
    table = [strategy for weight, strategy in choices for _ in range(weight)]
    return st.integers(0, len(table) - 1).flatmap(lambda i: table[i])


Placeholder = DocRun | Extend | RemoveRecent | StoreAgain
events: st.SearchStrategy[IndexEvent | Placeholder] = weighted(
    (5, runs), (5, extends), (5, removes), (4, stores_again), (1, st.just(ClearSource()))
)
batches = st.builds(
    Batch, st.sampled_from(SOURCES), st.lists(events, min_size=1, max_size=5).map(tuple)
)
steps: st.SearchStrategy[object] = weighted(
    (20, batches),
    (1, st.builds(Reset, st.sampled_from(SOURCES))),
    (1, st.builds(RemovePod, st.sampled_from(["p0", "p1"]))),
    (1, st.just(Restart())),
)
scenarios = st.lists(steps, min_size=1, max_size=30)


@dataclass
class History:
    """A source's earlier runs and stores, which placeholders refer to."""

    runs: list[DocRun] = field(default_factory=list)
    stores: list[StoreBlocks] = field(default_factory=list)


def _keys(path: Path) -> list[BlockKey]:
    return chain_keys(BlockKey(path[0]), list(path[1:]), BS)


async def _check(index: Index, model: Model) -> None:
    queries = model.held_paths() | {(ns, *doc) for ns in NAMESPACES for doc in DOCS}
    queries |= {(*p, 0, 1) for p in queries}
    for path in sorted(queries):
        hits = await index.lookup(_keys(path))
        got = {h.source: (h.blocks, h.score) for h in hits}
        want = model.lookup(path)
        assert set(got) == set(want), path
        for source, (blocks, score) in want.items():
            assert got[source][0] == blocks, (path, source)
            assert got[source][1] == pytest.approx(score), (path, source)
        assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    stats = {s.source: s for s in await index.stats()}
    for source, held in model.blocks.items():
        if source not in stats:
            assert not held
            continue
        paths_by_tier = {t: {p for ps, m in held.values() if m & t for p in ps} for t in Tier}
        assert stats[source].blocks == {t: len(paths_by_tier[t]) for t in Tier}


def _resolve(event: IndexEvent | Placeholder, history: History) -> list[IndexEvent]:
    """Placeholders become engine events from what the source did before."""
    if isinstance(event, RemoveRecent):
        recent = [(h, s.tier) for s in history.stores[-3:] for h in s.hashes]
        chosen = [recent[-1 - i] for i in event.back if i < len(recent)]
        if event.tier is not None:
            return [RemoveBlocks([h for h, _ in chosen], event.tier)]
        return [RemoveBlocks([h], tier) for h, tier in chosen]
    if isinstance(event, StoreAgain):
        if event.back >= len(history.stores):
            return []
        again = history.stores[-1 - event.back]
        hashes = [EngineHash(h ^ 0x5A5A) for h in again.hashes] if event.alias else again.hashes
        event = dataclasses.replace(again, hashes=hashes, tier=event.tier)
    if isinstance(event, Extend):
        if not history.runs:
            return []
        last = history.runs[-1]
        event = dataclasses.replace(
            last, first=last.first + last.count, count=event.count, tier=event.tier, noise="none"
        )
    if isinstance(event, DocRun):
        history.runs.append(event)
        store = event.event()
        if store is None:
            return []
        event = store
    if isinstance(event, StoreBlocks):
        history.stores.append(event)
    return [event]


async def _run(scenario: list[object], index: Index, restart: Callable[[], Index] | None) -> None:
    model = Model()
    seqs: dict[Source, int] = {}
    histories: dict[Source, History] = {}
    for step in scenario:
        if isinstance(step, Batch):
            history = histories.setdefault(step.source, History())
            batch = [e for event in step.events for e in _resolve(event, history)]
            seq = seqs[step.source] = seqs.get(step.source, -1) + 1
            got = await index.apply(SourceBatch(step.source, seq, float(seq), batch))
            assert got == model.apply(step.source, batch)
        elif isinstance(step, Reset):
            await index.reset_source(step.source)
            model.blocks[step.source] = {}
        elif isinstance(step, RemovePod):
            await index.remove_pod(step.pod)
            for source in [s for s in model.blocks if s.pod == step.pod]:
                del model.blocks[source]
        elif isinstance(step, Restart) and restart is not None:
            index = restart()
    await _check(index, model)


async def _check_redis_layout(client: aioredis.Redis, index: RedisIndex) -> None:
    """Every field is its generation's hash of its mask, every fingerprint the sum of its
    block's fields, and nothing retired is left."""
    assert await client.scard(index.keys.dead) == 0
    live = set(await client.hkeys(index.keys.live))
    async for name in client.scan_iter(f"{index.keys.block_prefix}*"):
        fields = await client.hgetall(name)
        holders = {g: int(v) for g, v in fields.items() if g != b"#"}
        assert set(holders) <= live
        assert all(fingerprints(int(g))[v % 8] == v for g, v in holders.items())
        assert int(fields[b"#"]) == sum(holders.values())


@settings(max_examples=500, deadline=None)
@given(scenarios)
def test_memory_index_equals_the_model(scenario: list[object]) -> None:
    asyncio.run(_run(scenario, MemoryIndex(BS), None))


@settings(max_examples=60, deadline=None)
@given(scenarios)
def test_fakeredis_index_equals_the_model(scenario: list[object]) -> None:
    async def run() -> None:
        client = fakeredis.FakeAsyncRedis()
        index = RedisIndex(client, BS)
        await _run(scenario, index, lambda: RedisIndex(client, BS))
        await _check_redis_layout(client, index)
        await client.aclose()

    asyncio.run(run())


@settings(max_examples=60, deadline=None)
@given(scenarios)
def test_redis_index_equals_the_model(redis_server: RedisServer, scenario: list[object]) -> None:
    async def run() -> None:
        client = aioredis.from_url(redis_server.url)
        await client.flushall()
        index = RedisIndex(client, BS)
        await _run(scenario, index, lambda: RedisIndex(client, BS))
        await _check_redis_layout(client, index)
        await client.aclose()

    asyncio.run(run())
