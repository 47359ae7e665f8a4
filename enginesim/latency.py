"""The time an emulated engine takes, so routing choices have visible consequences.

Prefill runs in steps, as a continuous-batching engine with chunked prefill does: each step
takes waiting requests first come first served up to `max_batch_tokens` uncached tokens
(a longer request is cut into chunks over several steps) and lasts

    step = sum(per_request_overhead for requests starting in the step) + tokens / tokens_per_s

so the time to first token grows with the uncached part of the prompt and with the prefill
work queued ahead. A request's queue time runs from its arrival to the start of its first
chunk; its prefill time from there to the end of its last chunk.

Decode emits tokens at a fixed per-request rate. Clock and sleep are injectable so tests
drive the model without waiting.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class PrefillModel:
    tokens_per_s: float
    per_request_overhead_s: float
    max_batch_tokens: int


@dataclass(frozen=True, slots=True)
class PrefillTiming:
    queue_s: float
    prefill_s: float


@dataclass(eq=False, slots=True)
class _Job:
    remaining: int
    arrived: float
    done: asyncio.Future[PrefillTiming]
    started: float | None = None


class PrefillScheduler:
    """One DP rank's prefill queue; `run()` returns once the request's tokens are computed."""

    def __init__(
        self, model: PrefillModel, *, clock: Clock = time.monotonic, sleep: Sleep = asyncio.sleep
    ) -> None:
        if model.tokens_per_s <= 0 or model.max_batch_tokens <= 0:
            raise ValueError("tokens_per_s and max_batch_tokens must be positive")
        self.model = model
        self._clock = clock
        self._sleep = sleep
        self._queue: deque[_Job] = deque()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def queued_tokens(self) -> int:
        """Uncached tokens waiting or running: the load a router would want to know."""
        return sum(job.remaining for job in self._queue if not job.done.done())

    @property
    def queued_requests(self) -> int:
        return sum(1 for job in self._queue if not job.done.done())

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="prefill-scheduler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for job in self._queue:
            if not job.done.done():
                job.done.cancel()
        self._queue.clear()

    async def run(self, tokens: int) -> PrefillTiming:
        if tokens <= 0:
            raise ValueError("a prefill computes at least one token")
        if self._task is None:
            raise RuntimeError("PrefillScheduler.start() was not called")
        job = _Job(tokens, self._clock(), asyncio.get_running_loop().create_future())
        self._queue.append(job)
        self._wakeup.set()
        return await job.done

    async def _loop(self) -> None:
        while True:
            while not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
            now = self._clock()
            step = self._plan_step(now)
            if not step:
                continue
            await self._sleep(self._step_seconds(step, now))
            end = self._clock()
            for job, chunk in step:
                job.remaining -= chunk
                if job.remaining == 0 and not job.done.done():
                    assert job.started is not None
                    job.done.set_result(PrefillTiming(job.started - job.arrived, end - job.started))
            self._queue = deque(job for job in self._queue if job.remaining > 0)

    def _plan_step(self, now: float) -> list[tuple[_Job, int]]:
        budget = self.model.max_batch_tokens
        step: list[tuple[_Job, int]] = []
        for job in list(self._queue):
            if job.done.done():
                self._queue.remove(job)
                continue
            if budget == 0:
                break
            chunk = min(job.remaining, budget)
            budget -= chunk
            step.append((job, chunk))
        return step

    def _step_seconds(self, step: Iterable[tuple[_Job, int]], now: float) -> float:
        seconds = 0.0
        for job, chunk in step:
            if job.started is None:
                job.started = now
                seconds += self.model.per_request_overhead_s
            seconds += chunk / self.model.tokens_per_s
        return seconds


async def paced(
    tokens: Iterable[int], tokens_per_s: float, *, sleep: Sleep = asyncio.sleep
) -> AsyncIterator[int]:
    """Yield decode tokens at the configured rate (the first one is the prefill's, at once)."""
    interval = 1.0 / tokens_per_s
    for index, token in enumerate(tokens):
        if index:
            await sleep(interval)
        yield token
