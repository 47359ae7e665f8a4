"""One replay from settings to summaries: every policy, the oracle lines, sweeps.

A *point* is one resolved cluster with its oracle lines and one record per policy; a plain
run is one point, `--sweep NAME=V1,V2,…` one point per value (every other parameter
unchanged, the policies compared side by side at each). Live mode runs each policy
through a real local stack and, for comparison, the simulation of the same settings.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.replay.config import ReplaySettings, ResolvedCluster, resolve
from bench.replay.gateways import GatewaysSimulation
from bench.replay.oracle import OracleLines, oracle_lines
from bench.replay.record import ProgressHook, RunRecord, summarize
from bench.replay.sim import Simulation
from bench.replay.sweep import Sweep
from bench.replay.trace import Trace, TraceStats, offered_work_per_s, read_trace, trace_stats


@dataclass(slots=True)
class Point:
    value: str | None
    settings: ReplaySettings
    cluster: ResolvedCluster
    oracle: OracleLines | None
    records: dict[str, RunRecord] = field(default_factory=dict)
    summaries: dict[str, dict[str, Any]] = field(default_factory=dict)
    sim_records: dict[str, RunRecord] = field(default_factory=dict)
    """Live mode: the simulation of the same settings, policy by policy."""
    sim_summaries: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(slots=True)
class Replay:
    settings: ReplaySettings
    trace: Trace
    stats: TraceStats
    points: list[Point]
    sweep: Sweep | None = None


def resolve_for(settings: ReplaySettings, trace: Trace, stats: TraceStats) -> ResolvedCluster:
    return resolve(
        settings.cluster,
        block_size=trace.block_size,
        unique_blocks=stats.unique_blocks,
        offered_work_per_s=offered_work_per_s(trace, settings.cluster.attention_tokens),
    )


def load(settings: ReplaySettings) -> tuple[Trace, TraceStats]:
    trace = read_trace(settings.trace, block_size=settings.block_size, limit=settings.limit)
    return trace, trace_stats(trace)


async def simulate(
    settings: ReplaySettings,
    trace: Trace,
    cluster: ResolvedCluster,
    progress: ProgressHook | None = None,
) -> dict[str, RunRecord]:
    records: dict[str, RunRecord] = {}
    for name in settings.policies:
        kind = Simulation if settings.gateways == 1 else GatewaysSimulation
        records[name] = await kind(trace, settings, cluster, name, progress).run()
    return records


def _summaries(records: dict[str, RunRecord], bucket_s: float) -> dict[str, dict[str, Any]]:
    return {name: summarize(record, bucket_s) for name, record in records.items()}


def run_point(
    settings: ReplaySettings,
    trace: Trace,
    stats: TraceStats,
    *,
    value: str | None = None,
    progress: ProgressHook | None = None,
    oracles: dict[str, OracleLines] | None = None,
) -> Point:
    cluster = resolve_for(settings, trace, stats)
    oracle = None
    if settings.oracle:
        key = cluster.model_dump_json()
        cache = oracles if oracles is not None else {}
        oracle = cache.get(key) or oracle_lines(trace, cluster)
        cache[key] = oracle
    point = Point(value, settings, cluster, oracle)
    bucket = settings.bucket_s
    if settings.mode == "live":
        from bench.replay.live import run_live

        point.records = run_live(settings, trace, cluster, progress)
        point.sim_records = asyncio.run(simulate(settings, trace, cluster, progress))
        point.sim_summaries = _summaries(point.sim_records, bucket)
    else:
        point.records = asyncio.run(simulate(settings, trace, cluster, progress))
    point.summaries = _summaries(point.records, bucket)
    return point


def run_replay(
    settings: ReplaySettings,
    *,
    sweep: Sweep | None = None,
    progress: ProgressHook | None = None,
) -> Replay:
    trace, stats = load(settings)
    values: Sequence[str | None] = sweep.values if sweep else [None]
    oracles: dict[str, OracleLines] = {}
    points = [
        run_point(
            sweep.apply(settings, value) if sweep and value is not None else settings,
            trace,
            stats,
            value=value,
            progress=progress,
            oracles=oracles,
        )
        for value in values
    ]
    return Replay(settings, trace, stats, points, sweep)
