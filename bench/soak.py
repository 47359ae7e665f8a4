"""Soak: many requests through a whole local cluster, to find the ones that take too long.

    python -m bench.soak [--requests 100000] [--clients 8] [--prefill 3] [--decode 2]
        [--redis] [--client-timeout 30] [--output bench/results/soak.json]

Starts `globalkv up`'s cluster (`LocalCluster`, the same plan and flags), with its own
`redis-server` on a free port when `--redis` is given (never the machine's), and drives
it with `--clients` closed-loop clients, one keep-alive connection each, sending
`/generate` with `input_ids`. The prompts are mixed, drawn per request from a seeded
generator:

- `shared`: 1,024 tokens of a prefix every client shares and 64 of its own (the shape
  that once hung), `max_new_tokens` 4;
- `group`: one of 32 prefixes of 256-768 tokens and 16-256 of its own, 1-16 new tokens;
- `fresh`: 32-1,024 tokens never sent before (nothing cached), 1-8 new tokens;
- any of them streamed (`stream: true`) one time in four.

Each request's time runs from its first byte written to its last byte read. The report
gives p50/p99/max, the count above 1 s, and for each slow request what was known of it
(its kind, status, the error's stage and message, the engines' `pd_stages_ms`) with the
load the machine had (`/proc/loadavg` sampled through the run, the other processes' CPU
share). A request that gets no answer within `--client-timeout` counts as a timeout and
its connection is replaced.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.gateway_load import read_answer, request_bytes
from bench.redis_process import redis_server
from globalkv.stack.cluster import LocalCluster, StackConfig

SLOW_S = 1.0
_SHARED_PREFIX = [(7 * i) % 50_000 + 3 for i in range(1024)]
_GROUPS = 32


@dataclass(slots=True)
class Outcome:
    kind: str
    stream: bool
    seconds: float
    status: int
    started: float
    """Seconds since the run began."""
    detail: dict[str, Any] = field(default_factory=dict)


class Prompts:
    """The mixed prompts, drawn from one seeded generator per client."""

    def __init__(self, client: int, seed: int, mix: str) -> None:
        self._mix = mix
        self._rng = random.Random(seed * 1000 + client)
        self._client = client
        self._fresh = 0
        group_rng = random.Random(seed)
        self._groups = [
            [group_rng.randrange(3, 50_000) for _ in range(group_rng.randrange(256, 769))]
            for _ in range(_GROUPS)
        ]

    def _own(self, count: int) -> list[int]:
        return [self._rng.randrange(3, 50_000) for _ in range(count)]

    def next(self) -> tuple[str, dict[str, Any]]:
        draw = self._rng.random() if self._mix == "mixed" else 0.0
        stream = self._mix == "mixed" and self._rng.random() < 0.25
        if draw < 0.5:
            kind, ids, new = "shared", _SHARED_PREFIX + self._own(64), 4
        elif draw < 0.85:
            group = self._groups[self._rng.randrange(_GROUPS)]
            kind, new = "group", self._rng.randint(1, 16)
            ids = group + self._own(self._rng.randint(16, 256))
        else:
            self._fresh += 1
            kind, new = "fresh", self._rng.randint(1, 8)
            ids = [self._client + 1, self._fresh, *self._own(self._rng.randint(30, 1022))]
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": new}, "stream": stream}
        return kind, body


def _detail(status: int, body: bytes) -> dict[str, Any]:
    """What the answer says about where the time went (JSON answer or SSE events)."""
    text = body.decode(errors="replace")
    found: dict[str, Any] = {}
    chunks = [line[6:] for line in text.splitlines() if line.startswith("data: ")] or [text]
    for chunk in chunks:
        try:
            value = json.loads(chunk)
        except ValueError:
            continue
        if isinstance(value, list) and value:
            value = value[0]
        if not isinstance(value, dict):
            continue
        if "error" in value:
            found["error"] = value["error"]
        meta = value.get("meta_info")
        if isinstance(meta, dict):
            for key in ("pd_stages_ms", "queue_ms", "prefill_ms", "bootstrap_ms"):
                if key in meta:
                    found[key] = meta[key]
    if status != 200 and not found:
        found["body"] = text[:300]
    return found


async def _client(
    index: int,
    host: str,
    port: int,
    args: argparse.Namespace,
    quota: Iterator[int],
    began: float,
    out: list[Outcome],
) -> None:
    prompts = Prompts(index, args.seed, args.mix)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        for _ in quota:
            kind, body = prompts.next()
            start = time.perf_counter()
            writer.write(request_bytes(host, port, "/generate", json.dumps(body).encode()))
            try:
                async with asyncio.timeout(args.client_timeout):
                    status, answer = await read_answer(reader)
            except TimeoutError:
                out.append(
                    Outcome(
                        kind,
                        body["stream"],
                        time.perf_counter() - start,
                        0,
                        start - began,
                        {"error": "client timeout"},
                    )
                )
                writer.close()
                reader, writer = await asyncio.open_connection(host, port)
                continue
            seconds = time.perf_counter() - start
            slow = seconds > SLOW_S or status != 200
            detail = _detail(status, answer) if slow else {}
            out.append(Outcome(kind, body["stream"], seconds, status, start - began, detail))
    finally:
        writer.close()


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return f.read().strip()


async def _sample_load(samples: list[tuple[float, str]], began: float, done: list[Outcome]) -> None:
    """Every 10 s: the load average, and a progress line on stderr."""
    while True:
        samples.append((round(time.perf_counter() - began, 1), _loadavg()))
        slow = sum(1 for o in done if o.seconds > SLOW_S)
        print(f"{len(done)} answered, {slow} above 1 s, load {samples[-1][1]}", file=sys.stderr)
        await asyncio.sleep(10)


Loads = list[tuple[float, str]]


async def _drive(
    host: str, port: int, args: argparse.Namespace
) -> tuple[list[Outcome], Loads, float]:
    quota = iter(range(args.requests))
    out: list[Outcome] = []
    loads: Loads = []
    began = time.perf_counter()
    sampler = asyncio.create_task(_sample_load(loads, began, out))
    try:
        await asyncio.gather(
            *(_client(i, host, port, args, quota, began, out) for i in range(args.clients))
        )
    finally:
        sampler.cancel()
    return out, loads, time.perf_counter() - began


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU of these processes so far (zero for one that is gone)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            continue
    return total / os.sysconf("SC_CLK_TCK")


def _machine_cpu_seconds() -> float:
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    busy = sum(values) - values[3] - values[4]
    return busy / os.sysconf("SC_CLK_TCK")


@contextmanager
def _redis(enabled: bool) -> Iterator[str | None]:
    if not enabled:
        yield None
        return
    with redis_server() as port:
        yield f"redis://127.0.0.1:{port}/0"


def summarize(outcomes: list[Outcome], seconds: float) -> dict[str, Any]:
    times = sorted(o.seconds for o in outcomes)

    def pct(q: float) -> float:
        return round(times[min(len(times) - 1, int(len(times) * q / 100))] * 1000, 2)

    slow = [o for o in outcomes if o.seconds > SLOW_S]
    return {
        "requests": len(outcomes),
        "seconds": round(seconds, 1),
        "requests_per_s": round(len(outcomes) / seconds, 1),
        "p50_ms": round(statistics.median(times) * 1000, 2),
        "p99_ms": pct(99),
        "p999_ms": pct(99.9),
        "max_ms": round(times[-1] * 1000, 2),
        "above_1s": len(slow),
        "not_200": sum(1 for o in outcomes if o.status != 200),
        "by_kind_p50_ms": {
            kind: round(statistics.median(o.seconds for o in outcomes if o.kind == kind) * 1000, 2)
            for kind in sorted({o.kind for o in outcomes})
        },
        "slow": [asdict(o) for o in sorted(slow, key=lambda o: -o.seconds)[:50]],
        "errors": [asdict(o) for o in outcomes if o.status != 200][:50],
    }


def markdown(report: dict[str, Any], command: str) -> str:
    """The report as the table `bench/results/` keeps beside the JSON."""
    machine = report["machine"]
    loads = [float(sample.split()[0]) for _, sample in machine["loadavg_samples"]]
    lines = [
        "# Soak: requests through `globalkv up`",
        "",
        f"    {command}",
        "",
        "| requests | req/s | p50 | p99 | p99.9 | max | above 1 s | not 200 |",
        "|---|---|---|---|---|---|---|---|",
        f"| {report['requests']} | {report['requests_per_s']} | {report['p50_ms']} ms "
        f"| {report['p99_ms']} ms | {report['p999_ms']} ms | {report['max_ms']} ms "
        f"| {report['above_1s']} | {report['not_200']} |",
        "",
        f"Median by kind: {report['by_kind_p50_ms']} (ms).",
        "",
        f"Machine: {machine['cpus']} CPUs; 1-minute load average {min(loads):.1f}–"
        f"{max(loads):.1f} during the run; the cluster and this client used "
        f"{machine['cluster_and_bench_cpu_share']} CPUs, other processes "
        f"{machine['other_processes_cpu_share']} CPUs on average.",
        "",
    ]
    for slow in report["slow"]:
        lines.append(f"- {slow['seconds']:.3f} s at {slow['started']:.0f} s: {json.dumps(slow)}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--prefill", type=int, default=3)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--redis", action="store_true", help="index in a throw-away Redis")
    parser.add_argument("--client-timeout", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--mix", choices=["mixed", "shared"], default="mixed", help="shared: only `shared`"
    )
    parser.add_argument("--gateway-args", default="", help="extra `globalkv gateway` flags")
    parser.add_argument("--run-dir", type=Path, help="the cluster's logs (default: under runs/)")
    parser.add_argument("--output", type=Path, help="write the JSON report here")
    args = parser.parse_args(argv)
    # A stopped run still stops its cluster and its redis-server (the with-blocks).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with ExitStack() as stack:
        redis_url = stack.enter_context(_redis(args.redis))
        config = StackConfig(
            prefill=args.prefill,
            decode=args.decode,
            redis_url=redis_url,
            run_dir=args.run_dir,
            log_level="WARNING",
            gateway_args=args.gateway_args.split(),
        )
        cluster = stack.enter_context(LocalCluster(config))
        pids = [c.pid for c in cluster.components if c.pid is not None]
        host, port = cluster.gateway_url.removeprefix("http://").rsplit(":", 1)
        cpu0, machine0 = _cpu_seconds(pids) + _own_cpu(), _machine_cpu_seconds()
        wall0 = time.monotonic()
        outcomes, loads, seconds = asyncio.run(_drive(host, int(port), args))
        cluster_cpu = _cpu_seconds(pids) + _own_cpu() - cpu0
        machine_cpu = _machine_cpu_seconds() - machine0
        wall = time.monotonic() - wall0
        report = summarize(outcomes, seconds)
        report["config"] = {k: str(v) for k, v in vars(args).items()}
        report["machine"] = {
            "cpus": os.cpu_count(),
            "loadavg_samples": loads,
            "cluster_and_bench_cpu_share": round(cluster_cpu / wall, 2),
            "other_processes_cpu_share": round(max(0.0, machine_cpu - cluster_cpu) / wall, 2),
        }
        report["run_dir"] = str(cluster.run_dir)
    text = json.dumps(report, indent=1)
    if args.output:
        args.output.write_text(text + "\n")
        command = "python -m bench.soak " + " ".join(argv if argv is not None else sys.argv[1:])
        args.output.with_suffix(".md").write_text(markdown(report, command))
    keys = ["requests", "requests_per_s", "p50_ms", "p99_ms", "p999_ms", "max_ms"]
    keys += ["above_1s", "not_200"]
    print(json.dumps({k: report[k] for k in keys}))
    print(json.dumps(report["machine"]))
    for slow in report["slow"][:10]:
        print(json.dumps(slow))
    return 0


def _own_cpu() -> float:
    times = os.times()
    return times.user + times.system


if __name__ == "__main__":
    sys.exit(main())
