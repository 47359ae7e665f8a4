from __future__ import annotations

from pathlib import Path

import pytest

from bench.replay.tokens import expand
from bench.replay.trace import (
    BUNDLED_MOONCAKE,
    TraceError,
    arrival_times,
    read_trace,
    trace_stats,
)
from tests.bench.traces import row, write_trace


def test_the_bundled_mooncake_trace_reproduces_the_published_figures() -> None:
    trace = read_trace(BUNDLED_MOONCAKE)
    stats = trace_stats(trace)
    assert trace.block_size == 512
    assert stats.requests == 12_031
    assert stats.block_refs == 288_500
    assert stats.unique_blocks == 182_790
    assert round(stats.duration_s) == 3_537
    assert round(stats.ceiling_blocks * 100, 2) == 36.64
    assert round(stats.ceiling_tokens * 100, 2) == 37.36


def test_limit_reads_the_first_requests_only() -> None:
    trace = read_trace(BUNDLED_MOONCAKE, limit=10)
    assert len(trace.requests) == 10
    assert trace.requests[0].hash_ids[:3] == (0, 1, 2)


def test_block_size_is_inferred_as_the_power_of_two_every_request_fits(tmp_path: Path) -> None:
    rows = [row(0, 7200, list(range(113))), row(5, 130, [0, 1, 2])]
    assert read_trace(write_trace(tmp_path / "t.jsonl", rows)).block_size == 64


def test_a_given_block_size_that_disagrees_names_the_request(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [row(0, 1024, [1, 2]), row(1, 600, [1, 2, 3])])
    with pytest.raises(TraceError, match=r"request 2: 3 hash_ids, but ceil\(600 / 512\) = 2"):
        read_trace(path, block_size=512)


def test_requests_are_replayed_in_timestamp_order(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [row(9, 8, [2]), row(1, 8, [1]), row(9, 8, [3])])
    assert [r.hash_ids for r in read_trace(path).requests] == [(1,), (2,), (3,)]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "t.jsonl:1: not JSON"),
        ("[1, 2]", "must be a JSON object"),
        (
            '{"timestamp": -1, "input_length": 4, "output_length": 1, "hash_ids": [1]}',
            "timestamp must be a number of ms >= 0",
        ),
        (
            '{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [1]}',
            "input_length must be an integer >= 1",
        ),
        (
            '{"timestamp": 0, "input_length": 4, "output_length": true, "hash_ids": [1]}',
            "output_length must be an integer >= 0",
        ),
        (
            '{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": []}',
            "hash_ids must be a non-empty list",
        ),
        (
            '{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1, "x"]}',
            "hash_ids must hold integers >= 0",
        ),
        (
            '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1, 2]}',
            "2 hash_ids for 1 input tokens",
        ),
    ],
)
def test_malformed_lines_are_refused_with_the_line_named(
    tmp_path: Path, line: str, message: str
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(TraceError, match=message):
        read_trace(path)


def test_missing_and_empty_traces_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read trace"):
        read_trace(tmp_path / "absent.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceError, match="no requests"):
        read_trace(tmp_path / "empty.jsonl")


def test_equal_timestamps_are_spread_to_the_next_step_or_kept_as_a_burst(
    tmp_path: Path,
) -> None:
    rows = [row(0, 8, [1]), row(0, 8, [2]), row(0, 8, [3]), row(3000, 8, [4]), row(6000, 8, [5])]
    requests = read_trace(write_trace(tmp_path / "t.jsonl", rows)).requests
    assert arrival_times(requests, "burst") == [0.0, 0.0, 0.0, 3.0, 6.0]
    assert arrival_times(requests, "spread") == pytest.approx([0.0, 1.0, 2.0, 3.0, 6.0])


def test_equal_block_ids_expand_to_equal_tokens_and_distinct_ids_do_not() -> None:
    a = expand([7, 8], 1000, 512)
    b = expand([7, 9], 1024, 512)
    assert len(a) == 1000
    assert len(b) == 1024
    assert a[:512] == b[:512]
    assert a[512:1000] != b[512:1000]
    assert all(0 <= t < 256 for t in a)
    assert expand([7, 8], 1000, 512) == a


def test_expansion_depends_on_the_block_size_and_respects_the_vocabulary() -> None:
    assert expand([3], 16, 16) != expand([3, 4], 16, 8)
    assert max(expand([1, 2, 3], 48, 16, vocab=50_000)) >= 256
    with pytest.raises(ValueError, match="cannot hold"):
        expand([1], 17, 16)
