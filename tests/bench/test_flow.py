"""bench.flow: tenants' trace slices, the fairness and percentile arithmetic, and a tiny
run of every kind through real processes."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from bench import flow
from bench.flow_report import (
    Result,
    RunResult,
    fair_shares,
    fairness,
    jain,
    paired,
    quantile_interval,
)
from bench.flow_workload import Tenant, slice_tenants
from bench.replay.trace import read_trace
from tests.bench.traces import row, write_trace


def _trace(tmp_path: Path, requests: int = 20, gap_ms: float = 100.0) -> Path:
    """Conversations of two turns: the second repeats the first's 2 blocks of 16."""
    rows = []
    for i in range(requests):
        base = 10 * (i // 2)
        ids = [base, base + 1] if i % 2 == 0 else [base, base + 1, base + 2]
        rows.append(row(i * gap_ms, 16 * len(ids), ids))
    return write_trace(tmp_path / "t.jsonl", rows)


def test_each_tenant_offers_its_share_from_its_own_window(tmp_path: Path) -> None:
    trace = read_trace(_trace(tmp_path))
    tenants = [Tenant("a", 0.5), Tenant("b", 1.0)]
    slices = slice_tenants(trace, tenants, capacity_tokens_per_s=100.0, seconds=4.0, seed=3)
    a, b = slices
    assert a.tokens >= 0.5 * 100 * 4
    assert a.tokens - a.requests[-1].input_length < 200
    assert b.tokens >= 100 * 4
    assert b.tokens - b.requests[-1].input_length < 400
    assert b.first == (a.first + len(a.requests)) % len(trace.requests)
    for s in slices:
        times = [r.at for r in s.requests]
        assert times == sorted(times)
        assert times[0] == 0.0
        assert times[-1] < 4.0
        assert [r.index for r in s.requests] == list(range(len(s.requests)))
    ids_a = {i for r in a.requests for i in r.hash_ids}
    ids_b = {i for r in b.requests for i in r.hash_ids}
    assert not ids_a & ids_b  # tenants share no prefix


def test_a_window_longer_than_the_trace_wraps_with_fresh_ids(tmp_path: Path) -> None:
    trace = read_trace(_trace(tmp_path, requests=4))
    (only,) = slice_tenants(trace, [Tenant("a", 1.0)], 100.0, seconds=4.0, seed=0)
    assert len(only.requests) > 2 * len(trace.requests)
    first, again = only.requests[0], only.requests[len(trace.requests)]
    assert first.input_length == again.input_length
    assert not set(first.hash_ids) & set(again.hash_ids)  # a second pass is new prefixes
    times = [r.at for r in only.requests]
    assert times == sorted(times)
    assert len(set(times)) == len(times)


def test_fair_shares_fill_the_smallest_demand_first() -> None:
    assert fair_shares({"light": 1.0, "steady": 5.0, "noisy": 40.0}, 6.0) == {
        "light": 1.0,
        "steady": 2.5,
        "noisy": 2.5,
    }
    assert fair_shares({"a": 1.0, "b": 1.0}, 5.0) == {"a": 1.0, "b": 1.0}
    assert jain([1.0, 1.0, 1.0]) == 1.0
    assert jain([2.0, 0.0]) == 0.5


def _result(tenant: str, index: int, ttft: float | None, length: int = 100) -> Result:
    status = 200 if ttft is not None else 429
    return Result(tenant, index, True, status, ttft, length)


def test_jain_is_over_fair_shares_not_raw_rates() -> None:
    """An under-share tenant served all it asked and two backlogged tenants served equally
    is fair (1.0), although their raw rates differ by 5x; served in proportion to demand,
    as FIFO serves, it is not."""
    fair = [_result("light", i, 0.1) for i in range(2)]
    fair += [_result("noisy", i, 0.1 if i < 10 else None) for i in range(100)]
    fair += [_result("steady", i, 0.1 if i < 10 else None) for i in range(20)]
    index, ratios = fairness(RunResult("flow", fair, 1.0), ["noisy", "steady", "light"])
    assert index == pytest.approx(1.0)
    assert ratios == pytest.approx({"noisy": 1.0, "steady": 1.0, "light": 1.0})
    fifo = [_result("light", i, 0.1 if i < 1 else None) for i in range(2)]
    fifo += [_result("noisy", i, 0.1 if i < 17 else None) for i in range(100)]
    fifo += [_result("steady", i, 0.1 if i < 4 else None) for i in range(20)]
    index, ratios = fairness(RunResult("fifo", fifo, 1.0), ["noisy", "steady", "light"])
    assert index < 0.8
    assert ratios["light"] == pytest.approx(0.5)


def test_the_p99_interval_is_unbounded_above_until_enough_samples() -> None:
    assert quantile_interval([float(i) for i in range(1, 301)], 0.99) == (293.0, math.inf)
    low, high = quantile_interval([float(i) for i in range(1, 1001)], 0.99)
    assert low < 990 < high < 1000
    assert quantile_interval([float(i) for i in range(1, 101)], 0.5) == (40.0, 61.0)


def test_paired_ratios_compare_each_request_with_itself() -> None:
    alone = [_result("p", 0, 1.0), _result("p", 1, 2.0), _result("p", 2, None)]
    loaded = [_result("p", 0, 1.5), _result("p", 1, 2.0), _result("p", 2, 9.0)]
    assert paired(loaded, alone) == [1.5, 1.0]


@pytest.mark.integration
def test_every_run_through_tiny_stacks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _trace(tmp_path, requests=40, gap_ms=50.0)
    argv = ["--trace", str(path), "--seconds", "3", "--warmup", "1", "--prefills", "2"]
    argv += ["--decodes", "1", "--prefill-tokens-per-s", "100", "--kv-capacity", "64"]
    argv += ["--noisy", "3", "--reserves", "1", "--queue-timeout", "5"]
    argv += ["--run-dir", str(tmp_path / "runs")]
    assert flow.main(argv) == 0
    out = capsys.readouterr().out
    assert not re.search(r"\bnan\b", out)
    for label in ("alone", "fifo", "flow, reserve 1", "flow, reserve 1, no noisy"):
        assert f"| {label} | premium |" in out, label
    assert "| flow, reserve 1 | light |" in out
    assert "Jain" in out
