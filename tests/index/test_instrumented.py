"""The metrics wrapper counts what the wrapped index did, in the registry it was given."""

from __future__ import annotations

import fakeredis
import pytest
from prometheus_client import CollectorRegistry

from globalkv.index.base import Index, IndexDataLost, IndexUnavailable, Tier
from globalkv.index.instrumented import InstrumentedIndex
from globalkv.index.memory import MemoryIndex
from globalkv.index.redis import RedisIndex
from tests.index.events import BS, P0, Feeder, clear, depths, keys, remove, store, tokens
from tests.support.metrics import sample


async def test_counts_applied_and_skipped_blocks_and_times_lookups() -> None:
    registry = CollectorRegistry()
    index = InstrumentedIndex(MemoryIndex(BS, max_entries=2), registry)
    assert isinstance(index, Index)
    feed = Feeder(index)
    t = tokens(4)
    await feed(P0, store([1, 2], t[: 2 * BS]), store([9], t[:BS], parent=77))
    await feed(P0, store([3], t[: BS + 1], block_size=BS + 1), remove([2], Tier.GPU))
    await feed(P0, store([4, 5], t[2 * BS :], parent=1), clear())
    await feed(P0, store([6], [2**32] * BS))
    assert depths(await index.lookup(keys(t))) == {}
    await index.reset_source(P0)
    await index.remove_pod("p0")
    assert sample(registry, "globalkv_index_applied_total", kind="stored") == 3
    assert sample(registry, "globalkv_index_applied_total", kind="removed") == 1
    assert sample(registry, "globalkv_index_applied_total", kind="cleared") == 1
    for reason in ("orphan", "partial", "over_capacity", "invalid"):
        assert sample(registry, "globalkv_index_skipped_blocks_total", reason=reason) == 1
    assert sample(registry, "globalkv_index_lookup_seconds_count") == 1
    assert sample(registry, "globalkv_index_apply_seconds_count") == 4
    assert sample(registry, "globalkv_index_source_resets_total") == 1
    assert sample(registry, "globalkv_index_pods_removed_total") == 1


async def test_counts_unavailable_and_data_lost_by_operation() -> None:
    server = fakeredis.FakeServer()
    client = fakeredis.FakeAsyncRedis(server=server)
    registry = CollectorRegistry()
    index = InstrumentedIndex(RedisIndex(client, BS), registry)
    feed = Feeder(index)
    await feed(P0, store([1], tokens(1)))
    await client.flushall()
    with pytest.raises(IndexDataLost):
        await feed(P0, store([2], tokens(1, start=BS), parent=1))
    server.connected = False
    with pytest.raises(IndexUnavailable):
        await index.lookup(keys(tokens(1)))
    with pytest.raises(IndexUnavailable):
        await index.stats()
    assert sample(registry, "globalkv_index_errors_total", op="apply", error="data_lost") == 1
    assert sample(registry, "globalkv_index_errors_total", op="lookup", error="unavailable") == 1
    assert sample(registry, "globalkv_index_errors_total", op="stats", error="unavailable") == 1
    await index.close()
    await client.aclose()
