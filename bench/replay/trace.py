"""Mooncake-format traces: reading, validating, arrival times and reuse statistics.

A trace line is `{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [..]}`
where each hash id names one block of `block_size` tokens *and everything before it*
(equal ids mean equal prefixes), the last block cut to the input length. The trace does
not state its block size; it is recovered from `len(hash_ids) == ceil(input_length / B)`,
which pins it to a narrow range on any real trace (512 for Mooncake's).

The Mooncake trace's timestamps come in ~3 s steps with up to 28 requests per step: they
were rounded, not sent in bursts. `arrival_times(..., "spread")` places a step's requests
evenly between its timestamp and the next one; "burst" keeps the rounded times. Traces
without repeated timestamps are unchanged by either.
"""

from __future__ import annotations

import gzip
import itertools
import json
import lzma
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

Arrivals = Literal["spread", "burst"]


class TraceError(ValueError):
    """The trace cannot be replayed; the message names the line and the field."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def conversation(request: TraceRequest) -> str:
    """The conversation `request` is a turn of, derived: Mooncake's trace names none, but
    every request opens with the same block (a shared system prompt) and the turns of one
    conversation share the block after it, so that block's id names the conversation."""
    ids = request.hash_ids
    return str(ids[1] if len(ids) > 1 else ids[0])


@dataclass(frozen=True, slots=True)
class Trace:
    requests: tuple[TraceRequest, ...]
    block_size: int
    source: str


@dataclass(frozen=True, slots=True)
class TraceStats:
    """Facts about the trace alone, before any routing, for the report's header."""

    requests: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    block_refs: int
    unique_blocks: int
    ceiling_blocks: float
    """Share of block references that repeat an earlier one: an unlimited cache's hit rate."""
    ceiling_tokens: float
    """The same weighted by tokens (a cut last block counts its length)."""

    @property
    def offered_tokens_per_s(self) -> float:
        return self.input_tokens / self.duration_s if self.duration_s > 0 else math.inf


def _field_int(row: dict[str, object], name: str, where: str, minimum: int) -> int:
    value = row.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceError(f"{where}: {name} must be an integer >= {minimum}, got {value!r}")
    return value


def _parse_line(text: str, where: str) -> TraceRequest:
    try:
        row = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(row, dict):
        raise TraceError(f"{where}: a trace line must be a JSON object")
    stamp = row.get("timestamp")
    if (
        isinstance(stamp, bool)
        or not isinstance(stamp, int | float)
        or not math.isfinite(stamp)
        or stamp < 0
    ):
        raise TraceError(f"{where}: timestamp must be a number of ms >= 0, got {stamp!r}")
    input_length = _field_int(row, "input_length", where, 1)
    output_length = _field_int(row, "output_length", where, 0)
    ids = row.get("hash_ids")
    if not isinstance(ids, list) or not ids:
        raise TraceError(f"{where}: hash_ids must be a non-empty list")
    for block_id in ids:
        if isinstance(block_id, bool) or not isinstance(block_id, int) or block_id < 0:
            raise TraceError(f"{where}: hash_ids must hold integers >= 0, got {block_id!r}")
    if len(ids) > input_length:
        raise TraceError(f"{where}: {len(ids)} hash_ids for {input_length} input tokens")
    return TraceRequest(float(stamp), input_length, output_length, tuple(ids))


def infer_block_size(requests: Sequence[TraceRequest]) -> int:
    """The block size every request agrees with; a power of two when the range allows.

    `len(ids) == ceil(L / B)` means `L / n <= B` and, for n > 1, `B <= (L - 1) / (n - 1)`.
    """
    low, high = 1, math.inf
    for req in requests:
        n, length = len(req.hash_ids), req.input_length
        low = max(low, -(-length // n))
        if n > 1:
            high = min(high, (length - 1) // (n - 1))
    if low > high:
        raise TraceError(
            "no block size fits every request's len(hash_ids) == ceil(input_length / B); "
            "give --block-size to see which line disagrees"
        )
    power = 1 << (low - 1).bit_length()
    return power if power <= high else low


def check_block_size(requests: Sequence[TraceRequest], block_size: int, source: str) -> None:
    for number, req in enumerate(requests, start=1):
        expected = -(-req.input_length // block_size)
        if len(req.hash_ids) != expected:
            raise TraceError(
                f"{source} request {number}: {len(req.hash_ids)} hash_ids, but "
                f"ceil({req.input_length} / {block_size}) = {expected}"
            )


def _open_text(path: Path) -> IO[str]:
    if path.suffix == ".xz":
        return lzma.open(path, "rt", encoding="utf-8")
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")


def read_trace(
    path: str | Path, *, block_size: int | None = None, limit: int | None = None
) -> Trace:
    """Read and validate a JSONL trace (plain, .gz or .xz), in timestamp order.

    Requests with equal timestamps keep their file order.
    """
    source = str(path)
    requests: list[TraceRequest] = []
    try:
        with _open_text(Path(path)) as handle:
            for number, line in enumerate(handle, start=1):
                if limit is not None and len(requests) >= limit:
                    break
                if line.strip():
                    requests.append(_parse_line(line, f"{source}:{number}"))
    except (OSError, EOFError, lzma.LZMAError) as exc:
        raise TraceError(f"cannot read trace {source}: {exc}") from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"{source}: not UTF-8 text ({exc.reason})") from None
    if not requests:
        raise TraceError(f"{source}: no requests")
    requests.sort(key=lambda r: r.timestamp_ms)
    if block_size is None:
        block_size = infer_block_size(requests)
    elif block_size <= 0:
        raise TraceError("block size must be positive")
    else:
        check_block_size(requests, block_size, source)
    return Trace(tuple(requests), block_size, source)


def trace_stats(trace: Trace) -> TraceStats:
    seen: set[int] = set()
    refs = hit_refs = tokens = hit_tokens = output = 0
    bs = trace.block_size
    for req in trace.requests:
        output += req.output_length
        for position, block_id in enumerate(req.hash_ids):
            size = min(bs, req.input_length - position * bs)
            refs += 1
            tokens += size
            if block_id in seen:
                hit_refs += 1
                hit_tokens += size
            else:
                seen.add(block_id)
    first, last = trace.requests[0].timestamp_ms, trace.requests[-1].timestamp_ms
    return TraceStats(
        requests=len(trace.requests),
        duration_s=(last - first) / 1000,
        input_tokens=tokens,
        output_tokens=output,
        block_refs=refs,
        unique_blocks=len(seen),
        ceiling_blocks=hit_refs / refs,
        ceiling_tokens=hit_tokens / tokens,
    )


BUNDLED_MOONCAKE = Path(__file__).parent / "traces" / "mooncake_conversation_trace.jsonl.xz"
"""The Mooncake conversation trace, bundled (see traces/README.md)."""


def offered_work_per_s(trace: Trace, attention_tokens: float | None = None) -> float:
    """Prompt work per second with no cache, in linear-token units.

    A token at context position p weighs `1 + p / attention_tokens` (see
    `bench.replay.pods`), so a prompt of L tokens weighs `L + L (L - 1) / (2 A)`.
    """
    first, last = trace.requests[0].timestamp_ms, trace.requests[-1].timestamp_ms
    work = 0.0
    for req in trace.requests:
        length = req.input_length
        work += length
        if attention_tokens is not None:
            work += length * (length - 1) / (2 * attention_tokens)
    duration = (last - first) / 1000
    return work / duration if duration > 0 else math.inf


def arrival_times(requests: Iterable[TraceRequest], arrivals: Arrivals) -> list[float]:
    """Seconds from the first request, with equal timestamps spread or kept as bursts."""
    stamps = [r.timestamp_ms / 1000 for r in requests]
    if not stamps:
        return []
    origin = stamps[0]
    times = [s - origin for s in stamps]
    if arrivals == "burst":
        return times
    steps = sorted(set(times))
    gaps = [b - a for a, b in itertools.pairwise(steps)]
    last_gap = sorted(gaps)[len(gaps) // 2] if gaps else 0.0
    next_step = dict(zip(steps, [*steps[1:], steps[-1] + last_gap], strict=True))
    out: list[float] = []
    start = 0
    while start < len(times):
        end = start
        while end < len(times) and times[end] == times[start]:
            end += 1
        width = (next_step[times[start]] - times[start]) / (end - start)
        out.extend(times[start] + k * width for k in range(end - start))
        start = end
    return out
