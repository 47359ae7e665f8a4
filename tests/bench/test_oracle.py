from __future__ import annotations

from pathlib import Path

import pytest

from bench.replay.config import ClusterModel, ResolvedCluster, resolve
from bench.replay.oracle import belady, oracle_lines, pooled_lru, ttft_floor, unlimited
from bench.replay.trace import BUNDLED_MOONCAKE, read_trace
from tests.bench.traces import row, write_trace


def _cluster(**fields: object) -> ResolvedCluster:
    model = ClusterModel.model_validate(fields)
    return resolve(model, block_size=4, unique_blocks=6, offered_work_per_s=1.0)


def _cyclic(tmp_path: Path) -> Path:
    """a b c a b c, one whole block each (5 tokens, block 4): LRU's worst case."""
    ids = [1, 2, 3, 1, 2, 3]
    rows = [row(i, 5, [block, 100 + i]) for i, block in enumerate(ids)]
    return write_trace(tmp_path / "cyclic.jsonl", rows)


def test_lru_thrashes_on_a_cycle_longer_than_the_cache_and_belady_does_not(
    tmp_path: Path,
) -> None:
    trace = read_trace(_cyclic(tmp_path), block_size=4)
    assert unlimited(trace) == pytest.approx(3 * 4 / 30)
    assert pooled_lru(trace, 2) == 0.0
    assert belady(trace, 2) == pytest.approx(2 * 4 / 30)
    assert belady(trace, 3) == unlimited(trace)


def test_only_whole_blocks_before_the_last_token_can_hit(tmp_path: Path) -> None:
    rows = [
        row(0, 9, [1, 2, 3]),
        row(1, 9, [1, 2, 4]),  # both whole blocks hit
        row(2, 8, [1, 5]),  # 8 tokens: block 5 holds the last token, only block 1 hits
        row(3, 12, [1, 5, 6]),  # 1 and 5 hit, 6 holds the last token
    ]
    trace = read_trace(write_trace(tmp_path / "t.jsonl", rows), block_size=4)
    assert unlimited(trace) == pytest.approx(5 * 4 / 38)
    assert pooled_lru(trace, 1) == pytest.approx(3 * 4 / 38)
    assert belady(trace, 1) == pytest.approx(3 * 4 / 38)
    assert belady(trace, 2) == pytest.approx(5 * 4 / 38)
    # Computed tokens with an unlimited cache: 9, 1, 4 and 4 (see the comments above).
    linear = _cluster(prefill_tokens_per_s=2.0, prefill_overhead_s=0.5)
    assert ttft_floor(trace, linear.model_copy(update={"kv_transfer_tokens_per_s": None})) == (
        pytest.approx((4 * 0.5 + 18 / 2) / 4)
    )
    assert ttft_floor(trace, linear) == pytest.approx((4 * 0.5 + 18 / 2 + 38 / 300_000) / 4)
    attention = _cluster(
        prefill_tokens_per_s=2.0,
        prefill_overhead_s=0.5,
        attention_tokens=10,
        kv_transfer_tokens_per_s=None,
    )
    weights = 9 + 72 / 20 + 1 + (72 - 56) / 20 + 4 + (56 - 12) / 20 + 4 + (132 - 56) / 20
    assert ttft_floor(trace, attention) == pytest.approx((4 * 0.5 + weights / 2) / 4)


def test_the_oracles_order_on_the_mooncake_trace() -> None:
    trace = read_trace(BUNDLED_MOONCAKE, limit=3000)
    lines = oracle_lines(trace, _cluster(pods=4, capacity_blocks=500, prefill_tokens_per_s=1e4))
    assert lines.capacity_blocks == 2000
    assert 0 < lines.pooled_lru < lines.belady <= lines.unlimited
    assert lines.ttft_floor_s > 0
