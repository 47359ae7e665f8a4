from __future__ import annotations

import asyncio

import pytest

from enginesim.latency import PrefillModel, PrefillScheduler, paced


class FakeTime:
    """A clock that only moves when the code under test sleeps; `hold` pauses every step."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []
        self.hold = asyncio.Event()
        self.hold.set()
        self.stepping = asyncio.Event()

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.stepping.set()
        await self.hold.wait()
        self.now += seconds
        await asyncio.sleep(0)


def scheduler(fake: FakeTime, max_batch_tokens: int = 100) -> PrefillScheduler:
    model = PrefillModel(
        tokens_per_s=1000.0, per_request_overhead_s=0.01, max_batch_tokens=max_batch_tokens
    )
    return PrefillScheduler(model, clock=fake.clock, sleep=fake.sleep)


async def test_prefill_time_is_overhead_plus_tokens_over_rate() -> None:
    fake = FakeTime()
    sched = scheduler(fake)
    sched.start()
    timing = await sched.run(50)
    await sched.stop()
    assert timing.queue_s == 0.0
    assert timing.prefill_s == pytest.approx(0.06)


async def test_requests_within_budget_share_a_step() -> None:
    fake = FakeTime()
    sched = scheduler(fake)
    sched.start()
    first, second = await asyncio.gather(sched.run(40), sched.run(60))
    await sched.stop()
    assert fake.sleeps == [pytest.approx(0.02 + 0.1)]
    assert first.queue_s == second.queue_s == 0.0
    assert first.prefill_s == second.prefill_s


async def test_long_request_is_chunked_and_delays_the_queue_behind_it() -> None:
    fake = FakeTime()
    sched = scheduler(fake, max_batch_tokens=100)
    sched.start()
    long_job = asyncio.create_task(sched.run(250))
    await asyncio.sleep(0)
    short = await sched.run(10)
    long_timing = await long_job
    await sched.stop()
    assert fake.sleeps == [
        pytest.approx(0.01 + 0.1),
        pytest.approx(0.1),
        pytest.approx(0.05 + 0.01 + 0.01),
    ]
    assert long_timing.queue_s == 0.0
    assert long_timing.prefill_s == pytest.approx(0.28)
    assert short.queue_s == pytest.approx(0.21)
    assert short.prefill_s == pytest.approx(0.07)


async def test_queued_tokens_reflect_waiting_work_and_cancelled_jobs_leave() -> None:
    fake = FakeTime()
    fake.hold.clear()
    sched = scheduler(fake, max_batch_tokens=20)
    sched.start()
    running = asyncio.create_task(sched.run(30))
    waiting = asyncio.create_task(sched.run(5))
    await fake.stepping.wait()
    assert (sched.queued_tokens, sched.queued_requests) == (35, 2)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert (sched.queued_tokens, sched.queued_requests) == (30, 1)
    fake.hold.set()
    assert (await running).prefill_s == pytest.approx(0.04)
    assert sched.queued_tokens == 0
    await sched.stop()


async def test_run_requires_started_scheduler_and_positive_tokens() -> None:
    sched = scheduler(FakeTime())
    with pytest.raises(ValueError, match="at least one token"):
        await sched.run(0)
    with pytest.raises(RuntimeError, match="start"):
        await sched.run(1)


async def test_paced_yields_first_token_at_once_then_at_rate() -> None:
    fake = FakeTime()
    got = [token async for token in paced([7, 8, 9], 50.0, sleep=fake.sleep)]
    assert got == [7, 8, 9]
    assert fake.sleeps == [pytest.approx(0.02), pytest.approx(0.02)]
