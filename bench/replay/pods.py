"""A simulated prefill pod: the engine's cache, its step scheduler, and its KV events.

The cache is `enginesim.kvcache.PagedKVCache` itself and a prompt goes through it as in
`enginesim.prefill.DPRank.prefill`: `match` when its first chunk is planned (locking the
prefix, so it reuses what the requests ahead of it stored), compute the uncached part,
`insert` the prompt and `release` the match when its last chunk ends, before the next
step is planned. The events the insert produces are turned into index events by the
emulated publisher's `wire_events` and the indexer's `translate`, the same two functions
the live path runs (minus msgpack and ZMQ), so the index is fed what it would be fed.

Time follows `enginesim.latency.PrefillScheduler` step for step, in discrete events
instead of sleeps: each step takes waiting requests first come first served up to
`max_batch_tokens` uncached tokens (chunking longer ones) and lasts the sum of the
per-request overheads of requests starting in it plus its tokens over the rate; requests
arriving during a step wait for the next. With `attention_tokens` set, a token at
context position p weighs `1 + p / attention_tokens` (the engine has no such term).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from bench.replay.record import PodStats
from enginesim.kvcache import Match, PagedKVCache
from enginesim.publisher import wire_events
from globalkv.index.base import Source, SourceBatch
from globalkv.translate import translate
from globalkv.wire import EventBatch


@dataclass(frozen=True, slots=True)
class StepModel:
    """A pod's prefill timing, in the simulation's (wall) seconds."""

    tokens_per_s: float
    overhead_s: float
    max_batch_tokens: int
    attention_tokens: float | None = None


@dataclass(eq=False, slots=True)
class PrefillJob:
    request: int
    tokens: Sequence[int]
    arrived: float
    match: Match | None = None
    """Taken, with `remaining`, when the first chunk is planned."""
    remaining: int = 0
    started: float | None = None

    @property
    def cached(self) -> int:
        return 0 if self.match is None else self.match.cached_tokens


@dataclass(frozen=True, slots=True)
class Finished:
    job: PrefillJob
    end: float
    batch: SourceBatch | None
    """The index events of the prompt's insert (evictions and stores), if any."""


class PrefillPod:
    def __init__(
        self, name: str, cache: PagedKVCache, model: StepModel, *, index_model: str
    ) -> None:
        self.name = name
        self.cache = cache
        self.model = model
        self._index_model = index_model
        self._source = Source(name)
        self._queue: deque[PrefillJob] = deque()
        self._step: list[tuple[PrefillJob, int]] = []
        self._seq = 0
        self.busy_s = 0.0
        self.computed_tokens = 0
        self.cached_tokens = 0

    def stats(self) -> PodStats:
        return PodStats(
            pod=self.name,
            computed_tokens=self.computed_tokens,
            cached_tokens=self.cached_tokens,
            evicted_blocks=self.cache.stats().evicted_pages,
            busy_s=self.busy_s,
        )

    def admit(self, request: int, tokens: Sequence[int], now: float) -> PrefillJob:
        """Queue the prompt; the cache is matched when its first chunk is planned."""
        job = PrefillJob(request, tokens, now)
        self._queue.append(job)
        return job

    def start_step(self, now: float) -> float | None:
        """Plan the next step if idle and work waits; returns when it ends."""
        if self._step or not self._queue:
            return None
        budget = self.model.max_batch_tokens
        seconds = 0.0
        for job in self._queue:
            if budget == 0:
                break
            if job.started is None:
                job.match = self.cache.match(job.tokens)
                job.remaining = len(job.tokens) - job.cached
                job.started = now
                seconds += self.model.overhead_s
            chunk = min(job.remaining, budget)
            budget -= chunk
            seconds += self._chunk_seconds(job, chunk)
            self._step.append((job, chunk))
        self.busy_s += seconds
        return now + seconds

    def _chunk_seconds(self, job: PrefillJob, chunk: int) -> float:
        weight = float(chunk)
        if self.model.attention_tokens is not None:
            first = len(job.tokens) - job.remaining
            mean_position = first + (chunk - 1) / 2
            weight += chunk * mean_position / self.model.attention_tokens
        return weight / self.model.tokens_per_s

    def end_step(self, now: float) -> list[Finished]:
        """Apply the step that ends now; the caller then calls `start_step` again."""
        finished: list[Finished] = []
        for job, chunk in self._step:
            job.remaining -= chunk
            if job.remaining == 0:
                finished.append(self._finish(job, now))
        self._step = []
        self._queue = deque(job for job in self._queue if job.started is None or job.remaining)
        return finished

    def _finish(self, job: PrefillJob, now: float) -> Finished:
        assert job.match is not None
        batch = self.store(job.tokens, now)
        self.cache.release(job.match)
        self.computed_tokens += len(job.tokens) - job.cached
        self.cached_tokens += job.cached
        return Finished(job, now, batch)

    def store(self, tokens: Sequence[int], now: float) -> SourceBatch | None:
        """Insert a prompt's pages (computed here, or pulled by a decode pod); the index
        events of the insert, if any."""
        changes = self.cache.insert(tokens)
        if not changes:
            return None
        events = wire_events(changes, self.cache.page_size, "sglang")
        translated = translate(EventBatch(now, events, 0), self._index_model)
        batch = SourceBatch(self._source, self._seq, now, translated.events)
        self._seq += 1
        return batch
