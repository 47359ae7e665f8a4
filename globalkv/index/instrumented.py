"""Metrics around any index, as a wrapper, so no backend holds metrics code.

Like llm-d's instrumented_index.go: the wrapped index is unchanged, every call is timed or
counted here, and the metrics live in the registry the component passes in.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Sequence
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram

from globalkv.index.base import (
    ApplyResult,
    Hit,
    Index,
    IndexDataLost,
    IndexUnavailable,
    Source,
    SourceBatch,
    SourceStats,
)
from globalkv.keys import BlockKey

_T = TypeVar("_T")
_LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip
_SKIPPED = {
    "orphan": "orphans",
    "partial": "partial",
    "over_capacity": "over_capacity",
    "invalid": "invalid",
}


class InstrumentedIndex:
    """An `Index` that records what the wrapped index does."""

    def __init__(self, inner: Index, registry: CollectorRegistry) -> None:
        self.inner = inner
        self.block_size = inner.block_size
        self.lookup_seconds = Histogram(
            "globalkv_index_lookup_seconds",
            "Time to answer one index lookup (with the hashing of keys a lazy chain leaves to "
            "the walk).",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.apply_seconds = Histogram(
            "globalkv_index_apply_seconds",
            "Time to apply one source batch.",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.applied = Counter(
            "globalkv_index_applied",
            "Engine blocks stored or removed, and clears applied.",
            ["kind"],
            registry=registry,
        )
        self.skipped = Counter(
            "globalkv_index_skipped_blocks",
            "Engine blocks of stores not indexed, by reason.",
            ["reason"],
            registry=registry,
        )
        self.resets = Counter(
            "globalkv_index_source_resets", "Sources reset (hidden and dropped).", registry=registry
        )
        self.pods_removed = Counter(
            "globalkv_index_pods_removed", "Pods removed from the index.", registry=registry
        )
        self.errors = Counter(
            "globalkv_index_errors",
            "Index calls that failed because the backend was unavailable or lost its data.",
            ["op", "error"],
            registry=registry,
        )
        for kind in ("stored", "removed", "cleared"):
            self.applied.labels(kind)
        for reason in _SKIPPED:
            self.skipped.labels(reason)

    async def lookup(self, keys: Sequence[BlockKey]) -> list[Hit]:
        with self.lookup_seconds.time():
            return await self._watch("lookup", self.inner.lookup(keys))

    async def apply(self, batch: SourceBatch) -> ApplyResult:
        start = time.perf_counter()
        result = await self._watch("apply", self.inner.apply(batch))
        self.apply_seconds.observe(time.perf_counter() - start)
        for kind in ("stored", "removed", "cleared"):
            count = getattr(result, kind)
            if count:
                self.applied.labels(kind).inc(count)
        for reason, attribute in _SKIPPED.items():
            count = getattr(result, attribute)
            if count:
                self.skipped.labels(reason).inc(count)
        return result

    async def reset_source(self, source: Source) -> None:
        await self._watch("reset_source", self.inner.reset_source(source))
        self.resets.inc()

    async def remove_pod(self, pod: str) -> None:
        await self._watch("remove_pod", self.inner.remove_pod(pod))
        self.pods_removed.inc()

    async def stats(self, pod: str | None = None) -> list[SourceStats]:
        return await self._watch("stats", self.inner.stats(pod))

    async def close(self) -> None:
        await self.inner.close()

    async def _watch(self, op: str, call: Awaitable[_T]) -> _T:
        try:
            return await call
        except IndexDataLost:
            self.errors.labels(op, "data_lost").inc()
            raise
        except IndexUnavailable:
            self.errors.labels(op, "unavailable").inc()
            raise
