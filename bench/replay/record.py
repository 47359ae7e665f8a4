"""What one policy's replay measured, per request, and the figures the report shows.

Sim and live mode fill the same record, so the summary (and every number compared
between them) is computed by one function. Times are stored in the run's wall seconds
and reported in trace seconds (divided by the time scale).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.replay.pods import PrefillPod
from gateway.policies import Choice
from globalkv.index.base import ApplyResult

_NAN = math.nan


@dataclass(frozen=True, slots=True)
class Progress:
    policy: str
    done: int
    total: int
    trace_time_s: float
    wall_s: float


@dataclass(frozen=True, slots=True)
class PodStats:
    pod: str
    busy_s: float
    computed_tokens: int
    cached_tokens: int
    evicted_blocks: int
    capacity_blocks: int


@dataclass(slots=True)
class RunRecord:
    policy: str
    time_scale: float
    arrival: list[float]
    worker: list[str]
    prompt: list[int]
    output: list[int]
    expected_hit: list[int]
    fallback: list[bool]
    cached: list[int]
    queue: list[float]
    prefill: list[float]
    ttft: list[float]
    done: list[float]
    pods: list[PodStats] = field(default_factory=list)
    index: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0

    @classmethod
    def empty(cls, policy: str, size: int, time_scale: float) -> RunRecord:
        return cls(
            policy,
            time_scale,
            arrival=[_NAN] * size,
            worker=[""] * size,
            prompt=[0] * size,
            output=[0] * size,
            expected_hit=[0] * size,
            fallback=[False] * size,
            cached=[0] * size,
            queue=[_NAN] * size,
            prefill=[_NAN] * size,
            ttft=[_NAN] * size,
            done=[_NAN] * size,
        )

    def routed(self, i: int, now: float, choice: Choice, *, tokens: int, output: int) -> None:
        self.arrival[i] = now
        self.worker[i] = choice.worker
        self.prompt[i] = tokens
        self.output[i] = output
        self.expected_hit[i] = choice.hit_tokens
        self.fallback[i] = choice.fallback is not None

    def served(self, i: int, *, cached: int, queue: float, prefill: float, ttft: float) -> None:
        self.cached[i] = cached
        self.queue[i] = queue
        self.prefill[i] = prefill
        self.ttft[i] = ttft

    def decoded(self, i: int, now: float) -> None:
        self.done[i] = now

    def close(self, pods: Iterable[PrefillPod], totals: ApplyResult, *, wall_s: float) -> None:
        self.pods = [
            PodStats(
                pod=p.name,
                busy_s=p.busy_s,
                computed_tokens=p.computed_tokens,
                cached_tokens=p.cached_tokens,
                evicted_blocks=p.cache.stats().evicted_pages,
                capacity_blocks=p.cache.capacity,
            )
            for p in pods
        ]
        self.index = {
            "stored": totals.stored,
            "removed": totals.removed,
            "orphans": totals.orphans,
            "partial": totals.partial,
            "over_capacity": totals.over_capacity,
            "invalid": totals.invalid,
        }
        self.wall_s = wall_s


def _pct(values: np.ndarray[Any, np.dtype[np.float64]], q: float) -> float:
    return float(np.percentile(values, q)) if values.size else _NAN


def summarize(record: RunRecord, bucket_s: float) -> dict[str, Any]:
    """The per-policy JSON object; every time in trace seconds."""
    scale = record.time_scale
    ttft = np.asarray(record.ttft, dtype=np.float64) / scale
    served = ttft[~np.isnan(ttft)]
    prompt = np.asarray(record.prompt, dtype=np.int64)
    cached = np.asarray(record.cached, dtype=np.int64)
    arrival = np.asarray(record.arrival, dtype=np.float64) / scale
    done = np.asarray(record.done, dtype=np.float64) / scale
    finished = ~np.isnan(done)
    makespan = float(np.nanmax(done) - np.nanmin(arrival)) if finished.any() else _NAN
    output_tokens = int(np.asarray(record.output, dtype=np.int64)[finished].sum())
    busy = np.asarray([p.busy_s for p in record.pods], dtype=np.float64) / scale
    mean_busy = float(busy.mean()) if busy.size else 0.0
    return {
        "policy": record.policy,
        "requests": len(record.prompt),
        "served": int(served.size),
        "hit_rate": float(cached.sum() / prompt.sum()) if prompt.sum() else 0.0,
        "hit_rate_expected": float(np.asarray(record.expected_hit).sum() / prompt.sum())
        if prompt.sum()
        else 0.0,
        "ttft_mean_s": float(served.mean()) if served.size else _NAN,
        "ttft_p50_s": _pct(served, 50),
        "ttft_p90_s": _pct(served, 90),
        "ttft_p99_s": _pct(served, 99),
        "queue_mean_s": float(np.nanmean(np.asarray(record.queue)) / scale),
        "prefill_mean_s": float(np.nanmean(np.asarray(record.prefill)) / scale),
        "throughput_tok_s": output_tokens / makespan if makespan and makespan > 0 else _NAN,
        "input_throughput_tok_s": float(prompt[finished].sum()) / makespan
        if makespan and makespan > 0
        else _NAN,
        "makespan_s": makespan,
        "load_imbalance": float(busy.max() / mean_busy) if mean_busy > 0 else _NAN,
        "utilisation": float(busy.sum() / (busy.size * makespan))
        if busy.size and makespan > 0
        else _NAN,
        "fallbacks": int(sum(record.fallback)),
        "evicted_blocks": sum(p.evicted_blocks for p in record.pods),
        "index": dict(record.index),
        "wall_s": record.wall_s,
        "hit_rate_over_time": hit_rate_over_time(arrival, prompt, cached, bucket_s),
    }


def hit_rate_over_time(
    arrival: np.ndarray[Any, np.dtype[np.float64]],
    prompt: np.ndarray[Any, np.dtype[np.int64]],
    cached: np.ndarray[Any, np.dtype[np.int64]],
    bucket_s: float,
) -> list[list[float]]:
    """[bucket start s, token hit rate of the requests arriving in it], non-empty buckets."""
    if not arrival.size:
        return []
    buckets = np.floor((arrival - arrival.min()) / bucket_s).astype(np.int64)
    width = int(buckets.max()) + 1
    tokens = np.bincount(buckets, weights=prompt, minlength=width)
    hits = np.bincount(buckets, weights=cached, minlength=width)
    return [
        [float(b * bucket_s), float(hits[b] / tokens[b])] for b in range(width) if tokens[b] > 0
    ]
