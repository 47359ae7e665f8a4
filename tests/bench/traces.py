"""Tiny hand-checkable traces written to a temporary file."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path


def write_trace(path: Path, rows: Sequence[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def row(ms: float, length: int, ids: Sequence[int], output: int = 4) -> dict[str, object]:
    return {"timestamp": ms, "input_length": length, "output_length": output, "hash_ids": ids}
