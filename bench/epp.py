"""The endpoint picker's CPU per request beside the least an ext_proc server can do.

    python -m bench.epp [--repeats 5] [--duration 2] [--concurrency 1,16] [--rates 300,600]
        [--modes buffered,buffered+headers,full-duplex] [--variant LABEL=DIR …] [--output FILE]

`globalkv epp` (an aggregated pool of two `bench.gateway_mocks` workers, `round_robin`:
what is measured is the path, not a cache) and `bench.epp_minimal` (the same messages
answered the same way, no picking) on each of its transports — grpc.aio, what a Python
ext_proc server is commonly written on, and h2, the picker's own: the picker's pick alone —
each sit behind their own Envoy 1.40 (`globalkv envoy`, one worker thread) in every
processing mode `globalkv.stack.envoy` renders:

- `buffered`: request headers, then the body BUFFERED, answered with the pick; nothing of
  the response (the default: two messages each way);
- `buffered+headers`: the same and the response's headers (`--response-headers`);
- `full-duplex`: the body FULL_DUPLEX_STREAMED and streamed back, the response's headers,
  body and trailers (`--body-mode full-duplex`).

The servers run alone on CPU 1; the Envoys, the mocks and the load on CPU 0 when the
machine has two. The load is `/generate` with 64 `input_ids`, answers not streamed:
closed-loop at each `--concurrency` (`bench.gateway`'s load generator: each server
answers as fast as it can, so a slower one also answers fewer at once), and paced at
each of `--rates` requests/s over 16 connections (every server then answers the same
requests at the same rate: the fairest comparison of CPU per request). Every repetition
measures every (load, mode, server) once, the order rotating; the table gives medians
over repetitions. "CPU µs/req" is a process's CPU time (all threads, from /proc) over
the answers it took part in: the server's (the picker, or the minimal one) and its
Envoy's, apart. `--variant LABEL=DIR` adds the picker of an export (another revision, or
`bench.gateway_compiled`'s compiled one), started from DIR, beside the others.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench.gateway import (
    HOST,
    PROMPT,
    Child,
    _body,
    _free_port,
    _spawn,
    _wait_ok,
    cpu_seconds,
    cpu_times,
)
from bench.gateway_load import read_answer, request_bytes, run_load
from bench.gateway_variant import variant

MODES = {
    "buffered": [],
    "buffered+headers": ["--response-headers"],
    "full-duplex": ["--body-mode", "full-duplex"],
}
MINIMAL = "minimal"
"""`bench.epp_minimal` on grpc.aio."""
MINIMAL_H2 = "minimal-h2"
"""`bench.epp_minimal` on the picker's own transport."""
MINIMALS = {MINIMAL: "grpc-aio", MINIMAL_H2: "h2"}
PACED_CONNECTIONS = 16


@dataclass(frozen=True)
class Target:
    port: int
    server: int
    envoy: int


@dataclass(frozen=True)
class Run:
    answered: int
    errors: int
    rps: float
    p50: float


async def paced(port: int, body: bytes, rate: float, duration: float) -> Run:
    """`rate` requests/s over `PACED_CONNECTIONS` keep-alive connections, each sending
    its next request at its next slot (or at once when the last answer came later)."""
    loop = asyncio.get_running_loop()
    payload = request_bytes(HOST, port, "/generate", body)
    interval = PACED_CONNECTIONS / rate
    start = loop.time() + 0.1
    stop = start + duration
    latencies: list[float] = []

    async def client(i: int) -> tuple[int, int]:
        reader, writer = await asyncio.open_connection(HOST, port)
        slot = start + i * interval / PACED_CONNECTIONS
        answered = errors = 0
        try:
            while slot < stop:
                await asyncio.sleep(max(slot - loop.time(), 0.0))
                began = loop.time()
                writer.write(payload)
                status, _ = await read_answer(reader)
                latencies.append(loop.time() - began)
                answered += 1
                errors += status != 200
                slot += interval
        finally:
            writer.close()
        return answered, errors

    counts = await asyncio.gather(*(client(i) for i in range(PACED_CONNECTIONS)))
    answered = sum(a for a, _ in counts)
    return Run(
        answered, sum(e for _, e in counts), answered / duration, statistics.median(latencies)
    )


@dataclass
class Cell:
    rps: list[float] = field(default_factory=list)
    p50_ms: list[float] = field(default_factory=list)
    server_us: list[float] = field(default_factory=list)
    server_sys_us: list[float] = field(default_factory=list)
    """Of `server_us`, the kernel's (system calls, wake-ups)."""
    envoy_us: list[float] = field(default_factory=list)


@contextmanager
def _started(
    logs: Path, pin: bool, modes: Sequence[str], variants: Sequence[tuple[str, str]]
) -> Iterator[dict[tuple[str, str], Target]]:
    """Every server (the picker, each variant's, the minimal one) behind an Envoy per
    mode, keyed by (mode, server)."""
    server_cpus, load_cpus = ({1}, {0}) if pin else (None, None)
    mocks = [_free_port(), _free_port()]
    endpoints = [f"{HOST}:{m}" for m in mocks]
    probe = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}
    with ExitStack() as stack:

        def spawn(name: str, argv: list[str], cpus: set[int] | None, cwd: str | None) -> Child:
            child = _spawn(name, argv, cpus, logs, cwd)
            stack.callback(child.stop)
            return child

        globalkv = [sys.executable, "-m", "globalkv"]
        mock_argv = [sys.executable, "-m", "bench.gateway_mocks", *map(str, mocks)]
        mock = spawn("mocks", mock_argv, load_cpus, None)
        _wait_ok(mock, f"http://{HOST}:{mocks[0]}/generate", probe)
        # (label, working directory): `python -m` puts the working directory first on
        # sys.path, so a variant's gateway/ is found before the installed one.
        pickers: list[tuple[str, str | None]] = [("epp", None), *variants]
        grpc = {name: _free_port() for name in [name for name, _ in pickers] + [*MINIMALS]}
        servers = {}
        for name, cwd in pickers:
            argv = [*globalkv, "epp", "--host", HOST, "--port", str(_free_port())]
            argv += ["--prometheus-port", "0", "--router-log-level", "warn"]
            argv += ["--policy", "round_robin", "--grpc-host", HOST, "--grpc-port", str(grpc[name])]
            argv += [a for m in mocks for a in ("--worker", f"http://{HOST}:{m}")]
            servers[name] = spawn(name, argv, server_cpus, cwd)
        for name, transport in MINIMALS.items():
            minimal = [sys.executable, "-m", "bench.epp_minimal", "--transport", transport]
            minimal += [str(grpc[name]), *endpoints]
            servers[name] = spawn(name, minimal, server_cpus, None)
        targets = {}
        for mode in modes:
            flags = MODES[mode]
            for name, server in servers.items():
                port = _free_port()
                argv = [*globalkv, "envoy", "--port", str(port), "--admin-port", str(_free_port())]
                argv += [a for e in endpoints for a in ("--endpoint", e)]
                argv += ["--picker", f"{HOST}:{grpc[name]}", *flags]
                envoy = spawn(f"envoy-{name}-{mode}", argv, load_cpus, None)
                _wait_ok(envoy, f"http://{HOST}:{port}/generate", probe)
                targets[(mode, name)] = Target(port, server.popen.pid, envoy.popen.pid)
        if load_cpus is not None:
            os.sched_setaffinity(0, load_cpus)
        yield targets


async def _measure(
    targets: dict[tuple[str, str], Target],
    loads: Sequence[str],
    repeats: int,
    duration: float,
) -> dict[tuple[str, str, str], Cell]:
    """`loads`: "c16" (closed loop, 16 at once) or "400/s" (paced)."""
    cells: dict[tuple[str, str, str], Cell] = {}
    keys = list(targets)
    body = _body(False)
    for rep in range(repeats):
        for load in loads:
            for key in keys[rep % len(keys) :] + keys[: rep % len(keys)]:
                target = targets[key]
                server, envoy = cpu_times(target.server), cpu_seconds(target.envoy)
                if load.endswith("/s"):
                    run = await paced(target.port, body, float(load[:-2]), duration)
                else:
                    closed = await run_load(
                        HOST,
                        target.port,
                        "/generate",
                        body,
                        concurrency=int(load[1:]),
                        duration=duration,
                    )
                    run = Run(closed.answered, closed.errors, closed.rps, closed.p50)
                if run.errors:
                    raise RuntimeError(f"{key}: {run.errors} answers were not 200")
                answered = max(run.answered, 1)
                cell = cells.setdefault((*key, load), Cell())
                cell.rps.append(run.rps)
                cell.p50_ms.append(run.p50 * 1000)
                user, system = cpu_times(target.server)
                cell.server_us.append((user + system - sum(server)) / answered * 1e6)
                cell.server_sys_us.append((system - server[1]) / answered * 1e6)
                cell.envoy_us.append((cpu_seconds(target.envoy) - envoy) / answered * 1e6)
        print(f"repetition {rep + 1}/{repeats} done", file=sys.stderr, flush=True)
    return cells


def table(
    cells: dict[tuple[str, str, str], Cell],
    loads: Sequence[str],
    modes: Sequence[str],
    pickers: Sequence[str],
) -> str:
    """A row per (mode, load, picker): the picker beside both minimal servers of the same
    repetitions, each ratio the median of the repetitions' ratios; then every server's
    CPU and the kernel's part of it (where grpc.aio spends most of its difference)."""
    head = [
        "mode",
        "load",
        "picker",
        "picker req/s",
        "picker p50 ms",
        "picker CPU µs/req",
        "minimal (grpc.aio) CPU µs/req",
        "picker / minimal (grpc.aio)",
        "minimal (h2) CPU µs/req",
        "picker / minimal (h2)",
        "Envoy CPU µs/req (picker)",
        "Envoy CPU µs/req (minimal grpc.aio)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for mode in modes:
        for c in loads:
            minimal, minimal_h2 = cells[(mode, MINIMAL, c)], cells[(mode, MINIMAL_H2, c)]
            for name in pickers:
                epp = cells[(mode, name, c)]
                row = [
                    mode,
                    c,
                    name,
                    f"{statistics.median(epp.rps):.0f}",
                    f"{statistics.median(epp.p50_ms):.2f}",
                    f"{statistics.median(epp.server_us):.0f}",
                    f"{statistics.median(minimal.server_us):.0f}",
                    f"{_ratio(epp, minimal):.2f}",
                    f"{statistics.median(minimal_h2.server_us):.0f}",
                    f"{_ratio(epp, minimal_h2):.2f}",
                    f"{statistics.median(epp.envoy_us):.0f}",
                    f"{statistics.median(minimal.envoy_us):.0f}",
                ]
                lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        "| mode | load | server | CPU µs/req | of which system |",
        "|---|---|---|---|---|",
    ]
    for mode in modes:
        for c in loads:
            for name in [*pickers, *MINIMALS]:
                cell = cells[(mode, name, c)]
                total = statistics.median(cell.server_us)
                system = statistics.median(cell.server_sys_us)
                lines.append(f"| {mode} | {c} | {name} | {total:.0f} | {system:.0f} |")
    return "\n".join(lines)


def _ratio(server: Cell, minimal: Cell) -> float:
    """The median over repetitions of the server's CPU per request over the minimal's."""
    ratios = [e / m for e, m in zip(server.server_us, minimal.server_us, strict=True)]
    return statistics.median(ratios)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.epp", description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--duration", type=float, default=2.0, help="seconds per cell")
    parser.add_argument("--concurrency", default="1,16", help="closed loop; comma-separated")
    parser.add_argument("--rates", default="300,600", help="paced requests/s; comma-separated")
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"processing modes measured; comma-separated, of {', '.join(MODES)}",
    )
    parser.add_argument(
        "--variant",
        type=variant,
        action="append",
        default=[],
        help="LABEL=DIR: also the picker of the export in DIR (bench.gateway_compiled)",
    )
    parser.add_argument("--no-pin", action="store_true", help="no CPU pinning")
    parser.add_argument("--output", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or not modes:
        parser.error(f"--modes: want some of {', '.join(MODES)}, got {args.modes!r}")
    loads = [f"c{int(c)}" for c in args.concurrency.split(",") if c]
    loads += [f"{float(r):g}/s" for r in args.rates.split(",") if r]
    pin = (os.cpu_count() or 1) >= 2 and not args.no_pin
    logs = Path(tempfile.mkdtemp(prefix="bench-epp-"))
    with _started(logs, pin, modes, args.variant) as targets:
        cells = asyncio.run(_measure(targets, loads, args.repeats, args.duration))
    text = table(cells, loads, modes, ["epp", *(label for label, _ in args.variant)])
    print(text)
    if args.output is not None:
        args.output.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
