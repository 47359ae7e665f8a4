"""What one policy's replay measured, per request, and the figures the report shows.

Sim and live mode fill the same record, so the summary (and every number compared
between them) is computed by one function. Times are stored in the run's wall seconds
and reported in trace seconds (divided by the time scale).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gateway.policies import Choice

_NAN = math.nan


@dataclass(frozen=True, slots=True)
class Progress:
    policy: str
    done: int
    total: int
    trace_time_s: float
    wall_s: float


ProgressHook = Callable[[Progress], None]


@dataclass(frozen=True, slots=True)
class PodStats:
    pod: str
    computed_tokens: int
    cached_tokens: int
    evicted_blocks: int
    busy_s: float | None = None
    """Simulated busy time (wall seconds); a live run does not measure it."""


@dataclass(slots=True)
class RunRecord:
    policy: str
    time_scale: float
    arrival: list[float]
    worker: list[str]
    prompt: list[int]
    output: list[int]
    expected_hit: list[int]
    indexed_hit: list[int | None]
    """The longest prefix any pod held in the index when the request was routed (None:
    the policy did not ask the index)."""
    fallback: list[bool]
    cached: list[int]
    queue: list[float]
    prefill: list[float]
    ttft: list[float]
    done: list[float]
    local: list[bool] = field(default_factory=list)
    """Prefilled on its decode pod instead of disaggregated."""
    stretched: list[list[float]] = field(default_factory=list)
    """Per request, its inter-token intervals a local prefill step held up (simulation)."""
    interval: float = _NAN
    """The decode's interval between two tokens (simulation; NaN: not measured)."""
    pods: list[PodStats] = field(default_factory=list)
    index: dict[str, int] = field(default_factory=dict)
    """What the simulated index applied (live mode: empty)."""
    failed: int = 0
    """Live requests the stack did not answer properly."""
    local_share: float | None = None
    """Live: the share of attempts the gateway prefilled on a decode (its metrics tell
    the share, not which requests); the simulation counts `local` per request."""
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
            indexed_hit=[None] * size,
            fallback=[False] * size,
            cached=[0] * size,
            queue=[_NAN] * size,
            prefill=[_NAN] * size,
            ttft=[_NAN] * size,
            done=[_NAN] * size,
            local=[False] * size,
            stretched=[[] for _ in range(size)],
        )

    def routed(
        self,
        i: int,
        now: float,
        choice: Choice,
        *,
        tokens: int,
        output: int,
        indexed_hit: int | None = None,
    ) -> None:
        self.arrival[i] = now
        self.worker[i] = choice.worker
        self.prompt[i] = tokens
        self.output[i] = output
        self.expected_hit[i] = choice.hit_tokens
        self.indexed_hit[i] = indexed_hit
        self.fallback[i] = choice.fallback is not None

    def served(self, i: int, *, cached: int, queue: float, prefill: float, ttft: float) -> None:
        self.cached[i] = cached
        self.queue[i] = queue
        self.prefill[i] = prefill
        self.ttft[i] = ttft

    def decoded(self, i: int, now: float) -> None:
        self.done[i] = now

    def close(self, pods: Iterable[PodStats], index: dict[str, int], *, wall_s: float) -> None:
        self.pods = list(pods)
        self.index = dict(index)
        self.wall_s = wall_s


def _pct(values: np.ndarray[Any, np.dtype[np.float64]], q: float) -> float:
    return float(np.percentile(values, q)) if values.size else _NAN


def summarize(record: RunRecord, bucket_s: float) -> dict[str, Any]:
    """The per-policy JSON object; every time in trace seconds.

    `hit_rate` is cached prompt tokens over prompt tokens, as the engines count them;
    `hit_rate_indexed` the longest prefix the index showed on any pod at routing time (for
    a policy that asks it), and `left_indexed_holder` how many requests went elsewhere;
    `throughput_tok_s` output tokens over the span from the first arrival to the last
    token; `load_imbalance` the busiest prefill pod's computed (uncached) tokens over
    the mean; `utilisation` the pods' simulated busy share of that span.
    """
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
    computed = np.asarray([p.computed_tokens for p in record.pods], dtype=np.float64)
    mean_computed = float(computed.mean()) if computed.size else 0.0
    busy = np.asarray([p.busy_s for p in record.pods if p.busy_s is not None]) / scale
    return {
        "policy": record.policy,
        "requests": len(record.prompt),
        "served": int(served.size),
        "failed_requests": record.failed,
        "hit_rate": float(cached.sum() / prompt.sum()) if prompt.sum() else 0.0,
        "hit_rate_expected": float(np.asarray(record.expected_hit).sum() / prompt.sum())
        if prompt.sum()
        else 0.0,
        **_indexed(record, int(prompt.sum())),
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
        "load_imbalance": float(computed.max() / mean_computed) if mean_computed > 0 else _NAN,
        "utilisation": float(busy.sum() / (busy.size * makespan))
        if busy.size and makespan > 0
        else _NAN,
        "local_share": record.local_share
        if record.local_share is not None
        else float(np.mean(record.local))
        if record.local
        else 0.0,
        **_inter_token(record, finished),
        "fallbacks": int(sum(record.fallback)),
        "evicted_blocks": sum(p.evicted_blocks for p in record.pods),
        "index": dict(record.index),
        "wall_s": record.wall_s,
        "hit_rate_over_time": hit_rate_over_time(arrival, prompt, cached, bucket_s),
    }


def _inter_token(
    record: RunRecord, finished: np.ndarray[Any, np.dtype[np.bool_]]
) -> dict[str, float]:
    """Inter-token latency over every interval of the finished requests (mean, p90, p99),
    and the p90 over requests of their mean interval (TPOT), in trace seconds; NaN where the
    run did not measure them (live)."""
    interval = record.interval
    none = {"itl_mean_s": _NAN, "itl_p90_s": _NAN, "itl_p99_s": _NAN, "tpot_p90_s": _NAN}
    if math.isnan(interval):
        return none
    regular = 0
    held: list[float] = []
    tpot: list[float] = []
    for i in np.flatnonzero(finished):
        gaps = max(record.output[i] - 1, 0)
        if not gaps:
            continue
        stretched = record.stretched[i]
        regular += gaps - len(stretched)
        held.extend(stretched)
        tpot.append((interval * (gaps - len(stretched)) + sum(stretched)) / gaps)
    if not tpot:
        return none
    values = np.asarray([interval, *held], dtype=np.float64)
    weights = np.asarray([regular] + [1] * len(held), dtype=np.float64)
    order = np.argsort(values, kind="stable")
    values, cumulative = values[order], np.cumsum(weights[order])
    scale = record.time_scale

    def pct(q: float) -> float:
        at = int(np.searchsorted(cumulative, q / 100 * cumulative[-1]))
        return float(values[min(at, values.size - 1)]) / scale

    return {
        "itl_mean_s": float((values * weights[order]).sum() / cumulative[-1]) / scale,
        "itl_p90_s": pct(90),
        "itl_p99_s": pct(99),
        "tpot_p90_s": float(np.percentile(np.asarray(tpot), 90)) / scale,
    }


def _indexed(record: RunRecord, prompt_tokens: int) -> dict[str, Any]:
    pairs = [
        (best, chosen)
        for best, chosen in zip(record.indexed_hit, record.expected_hit, strict=True)
        if best is not None
    ]
    if not pairs or not prompt_tokens:
        return {"hit_rate_indexed": None, "left_indexed_holder": None}
    return {
        "hit_rate_indexed": sum(best for best, _ in pairs) / prompt_tokens,
        "left_indexed_holder": sum(1 for best, chosen in pairs if chosen < best),
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
