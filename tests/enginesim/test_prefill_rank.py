"""A DP rank's prefill: its cache is matched when a prompt's first chunk is planned."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from enginesim.kvcache import PagedKVCache
from enginesim.latency import PrefillModel, PrefillScheduler
from enginesim.metrics import EngineMetrics
from enginesim.prefill import DPRank
from tests.enginesim.fake_time import FakeTime

PAGE = 4


def tokens(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def make_rank(fake: FakeTime, *, max_batch_tokens: int, capacity: int = 64) -> DPRank:
    model = PrefillModel(
        tokens_per_s=1000.0, per_request_overhead_s=0.01, max_batch_tokens=max_batch_tokens
    )
    return DPRank(
        index=0,
        cache=PagedKVCache(PAGE, capacity),
        scheduler=PrefillScheduler(model, clock=fake.clock, sleep=fake.sleep),
        publisher=None,
        metrics=EngineMetrics(CollectorRegistry()),
    )


async def test_a_prompt_queued_behind_its_prefix_reuses_what_that_one_computed() -> None:
    fake = FakeTime()
    fake.hold.clear()
    rank = make_rank(fake, max_batch_tokens=32)
    rank.scheduler.start()
    prefix = tokens(0, 32)
    first = asyncio.create_task(rank.prefill(prefix))
    second = asyncio.create_task(rank.prefill([*prefix, *tokens(100, 8)]))
    await fake.stepping.wait()
    assert rank.queued_tokens() == 32 + 40, "a waiting prompt counts what was missing on arrival"
    fake.hold.set()
    ahead, behind = await asyncio.gather(first, second)
    await rank.scheduler.stop()
    assert ahead.cached_tokens == 0
    assert ahead.timing.queue_s == 0.0
    assert ahead.timing.prefill_s == pytest.approx(0.01 + 0.032)
    assert behind.cached_tokens == 32
    assert behind.timing.queue_s == pytest.approx(0.042)
    assert behind.timing.prefill_s == pytest.approx(0.01 + 0.008)
    assert fake.sleeps == [pytest.approx(0.042), pytest.approx(0.018)]
    stats = rank.cache.stats()
    assert (stats.pages, stats.locked_pages) == (10, 0)


async def test_prompts_planned_into_one_step_find_nothing_of_each_other() -> None:
    fake = FakeTime()
    rank = make_rank(fake, max_batch_tokens=100)
    rank.scheduler.start()
    prefix = tokens(0, 32)
    results = await asyncio.gather(rank.prefill(prefix), rank.prefill([*prefix, *tokens(100, 8)]))
    await rank.scheduler.stop()
    assert [r.cached_tokens for r in results] == [0, 0]
    assert fake.sleeps == [pytest.approx(0.02 + 0.072)]


async def test_a_waiting_prompt_only_peeks_so_its_prefix_can_be_evicted_before_it_starts() -> None:
    fake = FakeTime()
    fake.hold.clear()
    rank = make_rank(fake, max_batch_tokens=40, capacity=10)
    rank.scheduler.start()
    prefix = tokens(0, 32)
    rank.cache.insert(prefix)
    unrelated = asyncio.create_task(rank.prefill(tokens(500, 40)))
    follow_up = asyncio.create_task(rank.prefill([*prefix, *tokens(100, 8)]))
    await fake.stepping.wait()
    assert rank.queued_tokens() == 40 + 8
    assert rank.cache.stats().locked_pages == 0
    fake.hold.set()
    ahead, behind = await asyncio.gather(unrelated, follow_up)
    await rank.scheduler.stop()
    assert ahead.cached_tokens == 0
    assert behind.cached_tokens == 0, "the unrelated prompt's pages evicted the unlocked prefix"
    assert rank.cache.stats().evicted_pages == 8 + 10


async def test_a_prompt_cancelled_before_or_after_its_first_chunk_keeps_nothing_locked() -> None:
    fake = FakeTime()
    fake.hold.clear()
    rank = make_rank(fake, max_batch_tokens=8)
    rank.scheduler.start()
    prefix = tokens(0, 32)
    rank.cache.insert(prefix)
    running = asyncio.create_task(rank.prefill([*prefix, *tokens(100, 12)]))
    waiting = asyncio.create_task(rank.prefill([*prefix, *tokens(200, 12)]))
    await fake.stepping.wait()
    assert rank.cache.stats().locked_pages == 8, "the running prompt locks the prefix it reuses"
    for task in (running, waiting):
        task.cancel()
    await asyncio.gather(running, waiting, return_exceptions=True)
    assert rank.cache.stats().locked_pages == 0
    fake.hold.set()
    after = await rank.prefill(tokens(900, 8))
    await rank.scheduler.stop()
    assert after.timing.queue_s == pytest.approx(0.018), "it waited for the cancelled chunk"
    assert len(rank.cache) == 8 + 2, "the cancelled prompts stored nothing"
