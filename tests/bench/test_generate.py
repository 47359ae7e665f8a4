"""The generated workloads read back as Mooncake traces with the stated shape."""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import replace
from pathlib import Path

import pytest

from bench.replay.generate import (
    CHAT_SHORT,
    LLMD73,
    WORKLOADS,
    ChatWorkload,
    Workload,
    main,
    requests,
    write,
)
from bench.replay.trace import read_trace, trace_stats

TINY = Workload(
    groups=3,
    prompts_per_group=2,
    system_tokens=256,
    question_tokens=100,
    output_tokens=5,
    requests=50,
    rate_per_s=10.0,
    skew=1.0,
)


def test_a_generated_trace_reads_back_with_its_groups_shared_prefixes(tmp_path: Path) -> None:
    out = tmp_path / "tiny.jsonl"
    with out.open("w") as f:
        assert write(TINY, f, seed=1) == 50
    trace = read_trace(out)
    assert trace.block_size == 64
    assert len(trace.requests) == 50
    # 4 shared blocks per group, then ceil(356 / 64) - 4 = 2 of the prompt's own.
    firsts = {r.hash_ids[:4] for r in trace.requests}
    assert len(firsts) <= 3
    assert all(len(r.hash_ids) == 6 for r in trace.requests)
    assert trace_stats(trace).unique_blocks <= 3 * 4 + 6 * 2
    times = [r.timestamp_ms for r in trace.requests]
    assert times == sorted(times)


def test_generation_is_seeded_and_skew_favours_one_group() -> None:
    assert list(requests(TINY, seed=2)) == list(requests(TINY, seed=2))
    assert list(requests(TINY, seed=2)) != list(requests(TINY, seed=3))
    skewed = replace(TINY, groups=10, requests=2000, skew=1.5)
    counts: dict[object, int] = {}
    for line in requests(skewed):
        first = line["hash_ids"][0]  # type: ignore[index]
        counts[first] = counts.get(first, 0) + 1
    assert max(counts.values()) > 2000 / 10 * 2


@pytest.mark.parametrize("name", sorted(set(WORKLOADS) - {"llmd73"}))
def test_the_cli_writes_each_named_workload(name: str, tmp_path: Path) -> None:
    out = tmp_path / f"{name}.jsonl"
    main([name, "-o", str(out)])
    trace = read_trace(out)
    workload = WORKLOADS[name]
    if isinstance(workload, ChatWorkload):
        assert len(trace.requests) == workload.conversations * workload.turns
        return
    assert isinstance(workload, Workload)
    assert len(trace.requests) == workload.requests


def test_a_chat_turn_extends_its_conversation() -> None:
    lines = list(requests(replace(CHAT_SHORT, conversations=1)))
    assert len(lines) == CHAT_SHORT.turns
    for before, after in itertools.pairwise(lines):
        full = int(before["input_length"]) // CHAT_SHORT.block_size  # type: ignore[call-overload]
        shared = before["hash_ids"][:full]  # type: ignore[index]
        assert after["hash_ids"][:full] == shared  # type: ignore[index]
        assert int(after["input_length"]) > int(before["input_length"]) + CHAT_SHORT.output_tokens  # type: ignore[call-overload]


LLMD73_SHA256 = "022627aca00c9b6cecb25fbfbad1de0653140b15c5d9165240b4b6243d0c006c"
"""The trace the llm-d figures of docs/routing-quality.md were measured on, byte for byte."""


def test_llmd73_is_the_trace_the_routing_quality_figures_replay(tmp_path: Path) -> None:
    out = tmp_path / "llmd73.jsonl"
    main(["llmd73", "-o", str(out)])
    assert hashlib.sha256(out.read_bytes()).hexdigest() == LLMD73_SHA256
    trace = read_trace(out)
    assert len(trace.requests) == 17_144
    assert len({r.hash_ids for r in trace.requests}) == 150 * 5
    assert len({r.hash_ids[:93] for r in trace.requests}) == 150  # 6,000 // 64 shared
    assert all(len(r.hash_ids) == 113 for r in trace.requests)  # ceil(7,200 / 64)
    assert trace.requests[-1].timestamp_ms <= sum(s for _, s in LLMD73.stages) * 1000
