from __future__ import annotations

from pathlib import Path

import pytest

from bench.replay.oracle import belady, oracle_lines, pooled_lru, unlimited
from bench.replay.trace import read_trace
from tests.bench.traces import row, write_trace


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
    lines = oracle_lines(trace, 1)
    assert lines.pooled_lru == pytest.approx(3 * 4 / 38)
    assert lines.belady == pytest.approx(3 * 4 / 38)
    assert oracle_lines(trace, 2).belady == pytest.approx(5 * 4 / 38)


def test_the_oracles_order_on_the_mooncake_trace(tmp_path: Path) -> None:
    from bench.replay.trace import BUNDLED_MOONCAKE

    trace = read_trace(BUNDLED_MOONCAKE, limit=3000)
    lines = oracle_lines(trace, 2000)
    assert 0 < lines.pooled_lru < lines.belady <= lines.unlimited
