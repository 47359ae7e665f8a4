from __future__ import annotations

import asyncio

import pytest

from enginesim.latency import PrefillModel, PrefillScheduler, PrefillTiming, paced
from tests.enginesim.fake_time import FakeTime


class Work:
    """A request whose cost is `tokens` once started; `log` records each hook with the time."""

    def __init__(
        self, name: str, tokens: int, log: list[tuple[str, str, float]], fake: FakeTime
    ) -> None:
        self.name = name
        self.tokens = tokens
        self.log = log
        self.fake = fake

    def start(self) -> int:
        self.log.append(("start", self.name, self.fake.now))
        return self.tokens

    def finish(self) -> None:
        self.log.append(("finish", self.name, self.fake.now))


class Failing:
    def __init__(self, hook: str) -> None:
        self.hook = hook

    def start(self) -> int:
        if self.hook == "start":
            raise RuntimeError("start failed")
        return 0 if self.hook == "nothing" else 5

    def finish(self) -> None:
        raise RuntimeError("finish failed")


async def run(sched: PrefillScheduler, fake: FakeTime, tokens: int) -> PrefillTiming:
    """A request that costs what it was estimated to cost."""
    return await sched.run(Work("w", tokens, [], fake), estimate=tokens)


def scheduler(fake: FakeTime, max_batch_tokens: int = 100) -> PrefillScheduler:
    model = PrefillModel(
        tokens_per_s=1000.0, per_request_overhead_s=0.01, max_batch_tokens=max_batch_tokens
    )
    return PrefillScheduler(model, clock=fake.clock, sleep=fake.sleep)


async def test_prefill_time_is_overhead_plus_tokens_over_rate() -> None:
    fake = FakeTime()
    sched = scheduler(fake)
    sched.start()
    timing = await run(sched, fake, 50)
    await sched.stop()
    assert timing.queue_s == 0.0
    assert timing.prefill_s == pytest.approx(0.06)


async def test_requests_within_budget_share_a_step() -> None:
    fake = FakeTime()
    sched = scheduler(fake)
    sched.start()
    first, second = await asyncio.gather(run(sched, fake, 40), run(sched, fake, 60))
    await sched.stop()
    assert fake.sleeps == [pytest.approx(0.02 + 0.1)]
    assert first.queue_s == second.queue_s == 0.0
    assert first.prefill_s == second.prefill_s


async def test_long_request_is_chunked_and_delays_the_queue_behind_it() -> None:
    fake = FakeTime()
    sched = scheduler(fake, max_batch_tokens=100)
    sched.start()
    long_job = asyncio.create_task(run(sched, fake, 250))
    await asyncio.sleep(0)
    short = await run(sched, fake, 10)
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
    running = asyncio.create_task(run(sched, fake, 30))
    waiting = asyncio.create_task(run(sched, fake, 5))
    await fake.stepping.wait()
    assert (sched.queued_tokens, sched.queued_requests) == (35, 2)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert (sched.queued_tokens, sched.queued_requests) == (30, 1)
    fake.hold.set()
    assert (await running).prefill_s == pytest.approx(0.04)
    assert sched.queued_tokens == 0
    await sched.stop()


async def test_a_request_is_priced_at_its_first_chunk_after_those_ahead_finish() -> None:
    fake = FakeTime()
    fake.hold.clear()
    sched = scheduler(fake, max_batch_tokens=100)
    sched.start()
    log: list[tuple[str, str, float]] = []
    ahead = asyncio.create_task(sched.run(Work("ahead", 100, log, fake), estimate=100))
    behind = asyncio.create_task(sched.run(Work("behind", 10, log, fake), estimate=100))
    await fake.stepping.wait()
    assert log == [("start", "ahead", 100.0)]
    assert (sched.queued_tokens, sched.queued_requests) == (200, 2)
    fake.stepping.clear()
    fake.hold.set()
    await fake.stepping.wait()
    assert log == [
        ("start", "ahead", 100.0),
        ("finish", "ahead", pytest.approx(100.11)),
        ("start", "behind", pytest.approx(100.11)),
    ]
    assert (sched.queued_tokens, sched.queued_requests) == (10, 1)
    timing = await behind
    assert fake.sleeps == [pytest.approx(0.01 + 0.1), pytest.approx(0.01 + 0.01)]
    assert timing.queue_s == pytest.approx(0.11)
    assert timing.prefill_s == pytest.approx(0.02)
    assert (await ahead).queue_s == 0.0
    await sched.stop()


@pytest.mark.parametrize(
    ("hook", "error"),
    [
        ("start", "start failed"),
        ("nothing", "at least one token, not 0"),
        ("finish", "finish failed"),
    ],
)
async def test_a_failing_hook_fails_its_request_and_the_queue_goes_on(
    hook: str, error: str
) -> None:
    fake = FakeTime()
    sched = scheduler(fake, max_batch_tokens=5)
    sched.start()
    failing = asyncio.create_task(sched.run(Failing(hook), estimate=5))
    after = asyncio.create_task(run(sched, fake, 5))
    with pytest.raises((RuntimeError, ValueError), match=error):
        await failing
    assert (await after).prefill_s == pytest.approx(0.015)
    assert sched.queued_tokens == 0
    await sched.stop()


async def test_run_requires_started_scheduler_and_positive_estimate() -> None:
    fake = FakeTime()
    sched = scheduler(fake)
    with pytest.raises(ValueError, match="at least one token"):
        await run(sched, fake, 0)
    with pytest.raises(RuntimeError, match="start"):
        await run(sched, fake, 1)


async def test_paced_yields_first_token_at_once_then_at_rate() -> None:
    fake = FakeTime()
    got = [token async for token in paced([7, 8, 9], 50.0, sleep=fake.sleep)]
    assert got == [7, 8, 9]
    assert fake.sleeps == [pytest.approx(0.02), pytest.approx(0.02)]
