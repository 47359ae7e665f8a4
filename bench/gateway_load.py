"""A closed-loop HTTP load generator cheap enough to share a core with the mock workers.

`concurrency` clients, one keep-alive connection each, send the same prebuilt request
back to back for `duration` seconds after a short warm-up; each request's time is taken
from its first byte written to its last byte read (a stream's `0` chunk), so a streamed
answer counts whole. Raw asyncio streams rather than an HTTP client library, so the load
generator's own cost stays small and identical for every target.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RunResult:
    requests: int
    seconds: float
    latencies: list[float]
    errors: int
    answered: int = 0
    """Every answer, the warm-up's included (what the target's CPU time was spent on)."""

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    def percentile(self, q: float) -> float:
        """Seconds; q in (0, 100)."""
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))]

    @property
    def p50(self) -> float:
        return statistics.median(self.latencies)

    @property
    def p99(self) -> float:
        return self.percentile(99)


def request_bytes(
    host: str, port: int, path: str, body: bytes, headers: Sequence[tuple[str, str]] = ()
) -> bytes:
    extra = "".join(f"{name}: {value}\r\n" for name, value in headers)
    head = (
        f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
        f"{extra}content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class BadAnswer(Exception):
    pass


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """Reads one response (sized or chunked); returns its status and body."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    lowered = head.lower()
    at = lowered.find(b"\r\ncontent-length:")
    if at >= 0:
        stop = lowered.find(b"\r\n", at + 2)
        return status, await reader.readexactly(int(lowered[at + 17 : stop]))
    if b"transfer-encoding: chunked" not in lowered:
        raise BadAnswer(f"neither content-length nor chunked: {head[:200]!r}")
    pieces = []
    while True:
        size = int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
        pieces.append((await reader.readexactly(size + 2))[:-2])
        if size == 0:
            return status, b"".join(pieces)


async def _client(
    host: str, port: int, payload: bytes, start: float, stop: float, out: list[float]
) -> tuple[int, int]:
    """Requests until `stop`; latencies of those started after `start` go to `out`.

    Returns (errors, answers).
    """
    reader, writer = await asyncio.open_connection(host, port)
    errors = answers = 0
    clock = time.perf_counter
    try:
        while True:
            began = clock()
            if began >= stop:
                return errors, answers
            writer.write(payload)
            status, _ = await read_answer(reader)
            answers += 1
            if status != 200:
                errors += 1
            if began >= start:
                out.append(clock() - began)
    finally:
        writer.close()


async def run_load(
    host: str,
    port: int,
    path: str,
    body: bytes,
    *,
    concurrency: int,
    duration: float,
    warmup: float = 0.3,
) -> RunResult:
    payload = request_bytes(host, port, path, body)
    now = time.perf_counter()
    start, stop = now + warmup, now + warmup + duration
    latencies: list[float] = []
    counts = await asyncio.gather(
        *(_client(host, port, payload, start, stop, latencies) for _ in range(concurrency))
    )
    errors = sum(e for e, _ in counts)
    return RunResult(len(latencies), duration, latencies, errors, sum(a for _, a in counts))
