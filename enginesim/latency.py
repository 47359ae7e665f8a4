"""The time an emulated engine takes, so routing choices have visible consequences.

Prefill runs in steps, as a continuous-batching engine with chunked prefill does: each step
takes waiting requests first come first served up to `max_batch_tokens` uncached tokens
(a longer request is cut into chunks over several steps) and lasts

    step = sum(per_request_overhead for requests starting in the step) + tokens / tokens_per_s

so the time to first token grows with the uncached part of the prompt and with the prefill
work queued ahead. A request's queue time runs from its arrival to the start of its first
chunk; its prefill time from there to the end of its last chunk.

What a request costs is decided when its first chunk is planned, not when it arrives: SGLang
matches the radix cache when it takes a waiting request into a prefill batch
(`Req.init_next_round_input`, called from `Scheduler._get_new_batch_prefill_raw`), so a
request queued behind another with the same prefix reuses what that one computed. Requests
planned into the same step are matched before any of them is computed, and find nothing of
each other, as in one SGLang batch. One simplification: a prompt's pages are stored when
its last chunk ends, where SGLang also stores a chunked prompt's pages after each chunk
(`mem_cache.common.checkpoint_kv_cache`), so a request sharing its holder's last step finds
nothing here but the earlier chunks there.

Decode emits tokens at a fixed per-request rate, except that a prefill step run on a
decode engine (a prompt it prefills itself) holds up the tokens due during it
(`DecodeStalls`). Clock and sleep are injectable so tests
drive the model without waiting.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from kvplumbing.clock import Clock, Sleep


@dataclass(frozen=True, slots=True)
class PrefillModel:
    tokens_per_s: float
    per_request_overhead_s: float
    max_batch_tokens: int


@dataclass(frozen=True, slots=True)
class PrefillTiming:
    queue_s: float
    prefill_s: float


class PrefillWork(Protocol):
    """A request as the scheduler drives it: priced when its first chunk is planned, kept
    when its last chunk ends.

    `finish` runs before the next step is planned, so the `start` of a request planned
    next already sees what this one stored.
    """

    def start(self) -> int:
        """Match (and lock) the cached prefix; return the tokens left to compute, at least 1."""
        ...

    def finish(self) -> None:
        """Keep what was computed (store the prompt's pages)."""
        ...


@dataclass(eq=False, slots=True)
class _Job:
    work: PrefillWork
    remaining: int
    """Until the first chunk is planned, the estimate the request arrived with."""
    arrived: float
    done: asyncio.Future[PrefillTiming]
    started: float | None = None


class PrefillScheduler:
    """One DP rank's prefill queue; `run()` returns once the request's tokens are computed."""

    def __init__(
        self,
        model: PrefillModel,
        *,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
        on_step: Callable[[float], None] | None = None,
    ) -> None:
        """`on_step(seconds)`: told of each step as it starts (a decode engine's running
        decodes wait for it, `DecodeStalls`)."""
        if model.tokens_per_s <= 0 or model.max_batch_tokens <= 0:
            raise ValueError("tokens_per_s and max_batch_tokens must be positive")
        self.model = model
        self._clock = clock
        self._sleep = sleep
        self._on_step = on_step
        self._queue: deque[_Job] = deque()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def queued_tokens(self) -> int:
        """Uncached tokens waiting or running: the load a router would want to know.

        A running request counts what it really has left; a waiting one the estimate it
        arrived with (what the cache lacked then), which overstates a request that will
        reuse the prefix of one ahead of it, as the gateway's own estimate does.
        """
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

    async def run(self, work: PrefillWork, *, estimate: int) -> PrefillTiming:
        """Queue `work`, counted as `estimate` uncached tokens until its first chunk."""
        if estimate <= 0:
            raise ValueError("a prefill computes at least one token")
        if self._task is None:
            raise RuntimeError("PrefillScheduler.start() was not called")
        job = _Job(work, estimate, self._clock(), asyncio.get_running_loop().create_future())
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
            seconds = self._step_seconds(step)
            if self._on_step is not None:
                self._on_step(seconds)
            await self._sleep(seconds)
            end = self._clock()
            for job, chunk, _ in step:
                job.remaining -= chunk
                if job.remaining == 0 and not job.done.done():
                    self._finish(job, end)
            self._queue = deque(job for job in self._queue if job.remaining > 0)

    def _plan_step(self, now: float) -> list[tuple[_Job, int, bool]]:
        """The step's chunks in queue order, each flagged when it is its request's first."""
        budget = self.model.max_batch_tokens
        step: list[tuple[_Job, int, bool]] = []
        for job in list(self._queue):
            if job.done.done():
                self._queue.remove(job)
                continue
            if budget == 0:
                break
            first = job.started is None
            if first and not self._start(job, now):
                continue
            chunk = min(job.remaining, budget)
            budget -= chunk
            step.append((job, chunk, first))
        return step

    def _start(self, job: _Job, now: float) -> bool:
        """Price the request now; a hook that fails fails its request, not the rank's loop."""
        try:
            tokens = job.work.start()
            if tokens <= 0:
                raise ValueError(f"a prefill computes at least one token, not {tokens}")
        except Exception as exc:
            job.done.set_exception(exc)
            self._queue.remove(job)
            return False
        job.remaining = tokens
        job.started = now
        return True

    def _finish(self, job: _Job, end: float) -> None:
        assert job.started is not None
        try:
            job.work.finish()
        except Exception as exc:
            job.done.set_exception(exc)
            return
        job.done.set_result(PrefillTiming(job.started - job.arrived, end - job.started))

    def _step_seconds(self, step: Iterable[tuple[_Job, int, bool]]) -> float:
        seconds = 0.0
        for _, chunk, first in step:
            if first:
                seconds += self.model.per_request_overhead_s
            seconds += chunk / self.model.tokens_per_s
        return seconds


class DecodeStalls:
    """Prefill steps on a decode engine, which its running decodes wait for.

    A decode engine that prefills a prompt itself runs the prefill's chunks in the steps
    that produce its running requests' tokens, so each of those tokens comes when the step
    ends: a token due while a prefill step runs is emitted at the step's end, and the next
    ones follow at the usual interval from there. The simulator's decode pods follow the
    same rule (`bench.replay.decodes`)."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self.until = 0.0

    def step(self, seconds: float) -> None:
        self.until = max(self.until, self._clock() + seconds)

    def wait_s(self) -> float:
        """How long a token due now waits for the prefill step running, if any."""
        return max(self.until - self._clock(), 0.0)


async def paced(
    tokens: Iterable[int],
    tokens_per_s: float,
    *,
    sleep: Sleep = asyncio.sleep,
    stalls: DecodeStalls | None = None,
) -> AsyncIterator[int]:
    """Yield decode tokens at the configured rate (the first one is the prefill's, at once),
    each one due during a prefill step on the same engine (`stalls`) at the step's end."""
    interval = 1.0 / tokens_per_s
    for index, token in enumerate(tokens):
        if index:
            await sleep(interval)
            if stalls is not None and (wait := stalls.wait_s()) > 0:
                await sleep(wait)
        yield token
