from __future__ import annotations

import asyncio
from pathlib import Path
from random import Random
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

import bench.replay.sim as sim_module
from bench.replay.config import ALL_POLICIES, ClusterModel, ReplaySettings, resolve
from bench.replay.pods import PrefillPod, StepModel
from bench.replay.record import RunRecord, summarize
from bench.replay.sim import Simulation, make_policies
from bench.replay.trace import offered_work_per_s, read_trace, trace_stats
from enginesim.kvcache import PagedKVCache
from enginesim.latency import PrefillModel, PrefillScheduler
from enginesim.metrics import EngineMetrics
from enginesim.prefill import DPRank
from gateway import policies as gateway_policies
from gateway.requests.query import RouteQuery
from gateway.settings.base import PolicyName
from gateway.settings.routing import PrefixWeights
from tests.bench.traces import row, write_trace

QUIET: dict[str, Any] = {
    "prefill_overhead_s": 0.0,
    "kv_transfer_tokens_per_s": None,
    "event_delay_s": 0.0,
    "decode_tokens_per_s": 1.0,
}


async def replay(
    path: Path,
    policy: PolicyName = "round_robin",
    time_scale: float = 1.0,
    prefix: PrefixWeights | None = None,
    **cluster: Any,
) -> RunRecord:
    settings = ReplaySettings(
        trace=str(path),
        policies=(policy,),
        arrivals="burst",
        time_scale=time_scale,
        cluster=ClusterModel(**{**QUIET, **cluster}),
        prefix=prefix or PrefixWeights(),
    )
    trace = read_trace(path, block_size=4)
    stats = trace_stats(trace)
    resolved = resolve(
        settings.cluster,
        block_size=trace.block_size,
        unique_blocks=stats.unique_blocks,
        offered_work_per_s=offered_work_per_s(trace),
    )
    return await Simulation(trace, settings, resolved, policy).run()


async def test_a_repeated_prefix_hits_and_prefills_only_the_rest(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [row(0, 9, [1, 2, 3]), row(10_000, 9, [1, 2, 4])])
    record = await replay(path, pods=1, capacity_blocks=8, prefill_tokens_per_s=4.0)
    assert record.cached == [0, 8]
    assert record.ttft == pytest.approx([9 / 4, 1 / 4])
    assert record.queue == [0.0, 0.0]
    assert record.done == pytest.approx([9 / 4 + 3, 10 + 1 / 4 + 3])
    summary = summarize(record, bucket_s=60)
    assert summary["hit_rate"] == pytest.approx(8 / 18)
    assert summary["index"]["stored"] == 2
    assert summary["throughput_tok_s"] == pytest.approx(8 / (10 + 0.25 + 3))


async def test_requests_queue_behind_the_steps_of_earlier_ones(tmp_path: Path) -> None:
    rows = [row(0, 8, [1, 2]), row(0, 8, [3, 4])]
    path = write_trace(tmp_path / "t.jsonl", rows)
    chunked = await replay(
        path, pods=1, capacity_blocks=8, prefill_tokens_per_s=4.0, max_batch_tokens=4
    )
    assert chunked.queue == [0.0, 2.0]
    assert chunked.prefill == [2.0, 2.0]
    assert chunked.ttft == [2.0, 4.0]
    batched = await replay(
        path,
        pods=1,
        capacity_blocks=8,
        prefill_tokens_per_s=4.0,
        max_batch_tokens=16,
        prefill_overhead_s=0.5,
    )
    assert batched.queue == [0.0, 0.0]
    assert batched.ttft == [5.0, 5.0]


async def test_evicted_blocks_stop_hitting_and_leave_the_index(tmp_path: Path) -> None:
    rows = [row(0, 8, [1, 2]), row(10_000, 8, [3, 4]), row(20_000, 8, [1, 5])]
    path = write_trace(tmp_path / "t.jsonl", rows)
    record = await replay(path, pods=1, capacity_blocks=2, prefill_tokens_per_s=100.0)
    assert record.cached == [0, 0, 0]
    assert record.pods[0].evicted_blocks == 4
    assert record.index == {
        "stored": 6,
        "removed": 4,
        "orphans": 0,
        "partial": 0,
        "over_capacity": 0,
        "invalid": 0,
    }


async def test_the_prefix_policy_sees_a_pod_s_blocks_only_after_the_event_delay(
    tmp_path: Path,
) -> None:
    rows = [row(0, 9, [1, 2, 3]), row(1_000, 9, [1, 2, 4])]
    path = write_trace(tmp_path / "t.jsonl", rows)
    kwargs: dict[str, Any] = {"pods": 4, "capacity_blocks": 8, "prefill_tokens_per_s": 100.0}
    prompt = await replay(path, "prefix", event_delay_s=0.5, **kwargs)
    assert prompt.indexed_hit == [0, 8]
    assert prompt.expected_hit == [0, 8]
    assert prompt.cached == [0, 8]
    assert prompt.worker[1] == prompt.worker[0]
    summary = summarize(prompt, bucket_s=60)
    assert summary["hit_rate_indexed"] == pytest.approx(8 / 18)
    assert summary["left_indexed_holder"] == 0
    index_only = PrefixWeights(pending_grace_secs=None)
    late = await replay(path, "prefix", event_delay_s=5.0, prefix=index_only, **kwargs)
    assert late.indexed_hit == [0, 0]
    assert late.expected_hit == [0, 0]
    blind = await replay(path, "least_load", **kwargs)
    assert blind.indexed_hit == [None, None]
    assert summarize(blind, bucket_s=60)["hit_rate_indexed"] is None


async def test_a_prompt_sent_to_a_pod_counts_as_held_there_until_the_grace_after_its_prefill(
    tmp_path: Path,
) -> None:
    """The first prompt's prefill answers at 0.09 s; its events would reach the index at
    5.09 s, the second prompt arrives at 1 s: only the pending record can send it along."""
    rows = [row(0, 9, [1, 2, 3]), row(1_000, 9, [1, 2, 4])]
    path = write_trace(tmp_path / "t.jsonl", rows)
    kwargs: dict[str, Any] = {"pods": 4, "capacity_blocks": 8, "prefill_tokens_per_s": 100.0}
    kept = await replay(path, "prefix", event_delay_s=5.0, **kwargs)
    assert kept.indexed_hit == [0, 0]
    assert kept.expected_hit == [0, 8]
    assert kept.worker[1] == kept.worker[0]
    assert kept.cached == [0, 8]
    short = PrefixWeights(pending_grace_secs=0.5)
    expired = await replay(path, "prefix", event_delay_s=5.0, prefix=short, **kwargs)
    assert expired.expected_hit == [0, 0]


@pytest.mark.parametrize("name", ALL_POLICIES)
def test_every_policy_replayed_is_the_gateway_s_own_object(
    name: PolicyName, tmp_path: Path
) -> None:
    settings = ReplaySettings(trace=str(tmp_path / "unused.jsonl"))
    prefill, decode = make_policies(settings, name)
    expected = gateway_policies.build_policy(name, Random(0))
    assert type(prefill) is type(expected)
    assert type(prefill).__module__.startswith("gateway.policies.")
    assert prefill.name == name
    assert type(decode) is gateway_policies.PowerOfTwoPolicy


async def test_the_simulation_routes_every_request_through_the_policy_it_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[tuple[str, list[str]]] = []

    def spying_build(name: PolicyName, rng: Random, **kwargs: Any) -> gateway_policies.Policy:
        policy = gateway_policies.build_policy(name, rng, **kwargs)
        choices: list[str] = []
        built.append((name, choices))
        real = policy.choose

        def choose(
            request: RouteQuery,
            candidates: Any,
        ) -> gateway_policies.Choice:
            choice = real(request, candidates)
            choices.append(choice.worker)
            return choice

        policy.choose = choose  # type: ignore[method-assign]
        return policy

    monkeypatch.setattr(sim_module, "build_policy", spying_build)
    rows = [row(i * 100, 8, [i, 50 + i]) for i in range(6)]
    record = await replay(
        write_trace(tmp_path / "t.jsonl", rows),
        "cache_aware",
        pods=3,
        capacity_blocks=8,
        prefill_tokens_per_s=100.0,
    )
    assert [name for name, _ in built] == ["cache_aware", "power_of_two"]
    assert built[0][1] == record.worker
    assert len(built[1][1]) == 6


async def test_the_time_scale_changes_the_clock_not_the_results(tmp_path: Path) -> None:
    rows = [row(i * 700, 13 + i % 4, [i % 3, 10 + i % 5, 20 + i, 30 + i]) for i in range(12)]
    path = write_trace(tmp_path / "t.jsonl", rows)
    kwargs: dict[str, Any] = {
        "pods": 2,
        "capacity_blocks": 3,
        "prefill_tokens_per_s": 8.0,
        "prefill_overhead_s": 0.1,
        "event_delay_s": 0.3,
        "kv_transfer_tokens_per_s": 50.0,
    }
    base = summarize(await replay(path, "prefix", **kwargs), bucket_s=60)
    fast = summarize(await replay(path, "prefix", time_scale=0.01, **kwargs), bucket_s=60)
    for key in ("hit_rate", "ttft_mean_s", "ttft_p90_s", "throughput_tok_s", "makespan_s"):
        assert fast[key] == pytest.approx(base[key]), key


async def test_the_pod_steps_and_matches_exactly_like_the_engine_s_prefill() -> None:
    """The engine's own rank (cache, scheduler, hooks) against the pod: queued requests
    reuse the prefixes of those ahead of them (2, 5, 6), one planned into its holder's
    last step finds nothing yet (4), and the cache is small enough to evict."""
    first, long, short = [1] * 5000, [8] * 12000, [15] * 300
    prompts = [
        first,
        long,
        [*first, *[2] * 3000],
        short,
        [*long, *[3] * 100],
        [*long, *[4] * 50],
        [*short, *[5] * 9000],
    ]
    now = [0.0]

    async def sleep(seconds: float) -> None:
        now[0] += seconds
        await asyncio.sleep(0)

    rank = DPRank(
        index=0,
        cache=PagedKVCache(16, 1500),
        scheduler=PrefillScheduler(
            PrefillModel(tokens_per_s=1000.0, per_request_overhead_s=0.005, max_batch_tokens=8192),
            clock=lambda: now[0],
            sleep=sleep,
        ),
        publisher=None,
        metrics=EngineMetrics(CollectorRegistry()),
    )
    rank.scheduler.start()
    try:
        served = await asyncio.gather(*(rank.prefill(prompt) for prompt in prompts))
    finally:
        await rank.scheduler.stop()
    pod = PrefillPod(
        "p",
        PagedKVCache(16, 1500),
        StepModel(tokens_per_s=1000.0, overhead_s=0.005, max_batch_tokens=8192),
        index_model="m",
    )
    jobs = [pod.admit(i, prompt, 0.0) for i, prompt in enumerate(prompts)]
    ends: dict[int, float] = {}
    end = pod.start_step(0.0)
    while end is not None:
        for done in pod.end_step(end):
            ends[done.job.request] = done.end
        end = pod.start_step(end)
    assert [job.cached for job in jobs] == [r.cached_tokens for r in served]
    assert [r.cached_tokens for r in served] == [0, 0, 4992, 0, 0, 12000, 288]
    for job, engine in zip(jobs, served, strict=True):
        assert job.started is not None
        assert job.started - job.arrived == pytest.approx(engine.timing.queue_s)
        assert ends[job.request] - job.started == pytest.approx(engine.timing.prefill_s)
    assert pod.cache.stats() == rank.cache.stats()
    assert rank.cache.stats().evicted_pages > 0
    assert [pod.cache.peek(p) for p in prompts] == [rank.cache.peek(p) for p in prompts]


def test_attention_weighs_each_token_by_its_position_in_steps_and_in_the_load() -> None:
    model = StepModel(tokens_per_s=100.0, overhead_s=0.0, max_batch_tokens=30, attention_tokens=50)
    pod = PrefillPod("p", PagedKVCache(16, 100), model, index_model="m")
    pod.admit(0, list(range(100)), 0.0)
    end = pod.start_step(0.0)
    steps = 0
    while end is not None:
        finished = pod.end_step(end)
        steps += 1
        last, end = end, pod.start_step(end)
    assert steps == 4
    assert finished[0].end == pytest.approx(last)
    assert last == pytest.approx((100 + 100 * 99 / (2 * 50)) / 100)


def test_the_offered_work_counts_the_attention_term(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [row(0, 8, [1, 2]), row(2_000, 4, [3])])
    trace = read_trace(path, block_size=4)
    assert offered_work_per_s(trace) == pytest.approx(12 / 2)
    assert offered_work_per_s(trace, 10) == pytest.approx((8 + 8 * 7 / 20 + 4 + 4 * 3 / 20) / 2)


async def test_the_prefix_policy_leaves_a_busy_holder_and_the_record_counts_it(
    tmp_path: Path,
) -> None:
    rows = [
        row(0, 9, [1, 2, 3]),
        row(10_000, 40, [1, 2, *range(10, 18)]),  # hits 8 on the holder, queues 32 there
        row(12_000, 9, [1, 2, 4]),  # the holder has 32 queued: 1 + 32 > 9 elsewhere
    ]
    path = write_trace(tmp_path / "t.jsonl", rows)
    record = await replay(path, "prefix", pods=2, capacity_blocks=16, prefill_tokens_per_s=1.0)
    assert record.worker[1] == record.worker[0]
    assert record.worker[2] != record.worker[0]
    assert record.indexed_hit == [0, 8, 8]
    assert record.expected_hit == [0, 8, 0]
    assert summarize(record, bucket_s=60)["left_indexed_holder"] == 1


async def test_the_simulated_prefills_report_their_capacity_to_the_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As an engine's /server_info does live: pages × page size, for every prefill."""
    seen: list[set[tuple[str, int | None]]] = []

    def spying_build(name: PolicyName, rng: Random, **kwargs: Any) -> gateway_policies.Policy:
        policy = gateway_policies.build_policy(name, rng, **kwargs)
        real = policy.choose

        def choose(request: RouteQuery, candidates: Any) -> gateway_policies.Choice:
            seen.append({(c.worker, c.cache_capacity_tokens) for c in candidates})
            return real(request, candidates)

        policy.choose = choose  # type: ignore[method-assign]
        return policy

    monkeypatch.setattr(sim_module, "build_policy", spying_build)
    rows = [row(i * 100, 8, [i, 50 + i]) for i in range(3)]
    await replay(
        write_trace(tmp_path / "t.jsonl", rows),
        "prefix",
        pods=2,
        capacity_blocks=8,
        prefill_tokens_per_s=100.0,
    )
    prefills = {("prefill-0", 32), ("prefill-1", 32)}
    decodes = {("decode-0", None), ("decode-1", None)}
    assert seen == [prefills, decodes] * 3
