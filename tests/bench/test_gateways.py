"""The replay through several gateway replicas: what they see of each other."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.replay.config import ClusterModel, ReplaySettings, resolve
from bench.replay.gateways import GatewaysSimulation, _SharedRun
from bench.replay.record import RunRecord
from bench.replay.trace import offered_work_per_s, read_trace, trace_stats
from gateway.settings.base import PolicyName
from tests.bench.test_sim import QUIET
from tests.bench.traces import row, write_trace


async def replay(
    path: Path, policy: PolicyName, gateways: int, sharing: str, interval: float, **cluster: Any
) -> RunRecord:
    return await simulation(path, policy, gateways, sharing, interval, **cluster).run()


def simulation(
    path: Path, policy: PolicyName, gateways: int, sharing: str, interval: float, **cluster: Any
) -> GatewaysSimulation:
    settings = ReplaySettings(
        trace=str(path),
        policies=(policy,),
        arrivals="burst",
        cluster=ClusterModel(**{**QUIET, **cluster}),
        gateways=gateways,
        gateway_sharing=sharing,  # type: ignore[arg-type]
        share_interval_s=interval,
    )
    trace = read_trace(path, block_size=4)
    stats = trace_stats(trace)
    resolved = resolve(
        settings.cluster,
        block_size=trace.block_size,
        unique_blocks=stats.unique_blocks,
        offered_work_per_s=offered_work_per_s(trace),
    )
    return GatewaysSimulation(trace, settings, resolved, policy)


async def test_a_prompt_sent_by_another_gateway_counts_as_pending_once_it_is_shared(
    tmp_path: Path,
) -> None:
    """Request 0 goes through gateway 0, request 1 (same prefix, 1 s later) through
    gateway 1; the index learns of request 0's blocks only at 5 s."""
    path = write_trace(tmp_path / "t.jsonl", [row(0, 9, [1, 2, 3]), row(1_000, 9, [1, 2, 4])])
    kwargs: dict[str, Any] = {"pods": 4, "capacity_blocks": 8, "prefill_tokens_per_s": 100.0}
    kwargs["event_delay_s"] = 5.0
    shared = await replay(path, "prefix", 2, "shared", 0.5, **kwargs)
    assert shared.expected_hit == [0, 8]
    assert shared.worker[1] == shared.worker[0]
    assert shared.cached == [0, 8]
    late = await replay(path, "prefix", 2, "shared", 2.0, **kwargs)  # not received yet
    assert late.expected_hit == [0, 0]
    alone = await replay(path, "prefix", 2, "none", 0.5, **kwargs)
    assert alone.expected_hit == [0, 0]


async def test_a_gateway_adds_the_others_published_load_to_its_own(tmp_path: Path) -> None:
    """Eight prompts at one instant through two gateways, eight idle pods: sharing at once,
    each choice sees every earlier one and all eight pods get one; alone, each gateway
    spreads only its own four (ties among pods it thinks idle are drawn at random)."""
    rows = [row(0, 8, [2 * i + 1, 2 * i + 2]) for i in range(8)]
    path = write_trace(tmp_path / "t.jsonl", rows)
    kwargs: dict[str, Any] = {"pods": 8, "capacity_blocks": 8, "prefill_tokens_per_s": 10.0}
    shared = await replay(path, "least_load", 2, "shared", 0.0, **kwargs)
    assert len(set(shared.worker)) == 8
    alone = await replay(path, "least_load", 2, "none", 0.0, **kwargs)
    for gateway in (0, 1):
        assert len(set(alone.worker[gateway::2])) == 4
    stale = await replay(path, "least_load", 2, "shared", 10.0, **kwargs)
    for gateway in (0, 1):  # nothing published yet at 0 s but the empty start
        assert len(set(stale.worker[gateway::2])) == 4


def test_every_replica_sees_the_capacity_each_prefill_reports(tmp_path: Path) -> None:
    """As each live gateway reads it from the engines: without it a replica's prefix
    policy would weigh no cache pressure, and G replicas would replay another policy."""
    path = write_trace(tmp_path / "t.jsonl", [row(0, 9, [1, 2, 3])])
    kwargs: dict[str, Any] = {"pods": 3, "capacity_blocks": 8, "prefill_tokens_per_s": 10.0}
    sim = simulation(path, "prefix", 2, "shared", 0.1, **kwargs)
    run = _SharedRun(sim, 0.0)
    for replica in run.replicas:
        candidates = run._candidates(replica, run.prefills, 0.0)
        assert [c.cache_capacity_tokens for c in candidates] == [8 * 4] * 3
