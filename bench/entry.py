"""The entry points' own cost, side by side: requests/s and added latency per way in.

    python -m bench.entry [--repeats 3] [--duration 2] [--concurrency 1,16,64] [--output FILE]

Against the instant mock workers of `bench.gateway_mocks` (answers prebuilt), measured in
one run with `bench.gateway`'s load generator and interleaved rounds (every repetition
measures every target once per cell, in rotating order; the tables give medians, the
added latency the median of per-repetition differences to the direct call):

- `direct`: one mock, no router;
- `envoy+epp`: Envoy (`globalkv envoy`, one worker thread) calling `globalkv epp` over
  ext_proc, sending each request whole to one of two mocks (an aggregated pool, the
  picker's `round_robin` policy: what is measured is the path, not a cache);
- `envoy+epp-headers`: the same with `--no-stream-response`: the picker sees the
  response's headers, not its body (less work; in-flight counts end at the headers);
- `envoy-rr`: the same Envoy without a picker, round robin over the two mocks;
- `gateway`: `globalkv gateway` over two prefill and two decode mocks, `round_robin`
  (it makes two upstream calls per request, the PD legs; Envoy's paths make one).

The routers (Envoy and the picker together, or the gateway) run on CPU 1, the mocks and
the load on CPU 0, when the machine has two CPUs. "CPU µs/req" is the router processes'
CPU time (all of them: Envoy's and the picker's for `envoy+epp`) per answer.
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
from pathlib import Path

from bench.gateway import (
    HOST,
    PROMPT,
    Cell,
    Child,
    Key,
    _added,
    _body,
    _free_port,
    _spawn,
    _wait_ok,
    cpu_seconds,
    router_argv,
)
from bench.gateway_load import run_load

TARGETS = ("envoy+epp", "envoy+epp-headers", "envoy-rr", "gateway")


@contextmanager
def _started(logs: Path, pin: bool) -> Iterator[dict[str, tuple[int, list[int]]]]:
    """Each target's port and the pids of its router processes (none for `direct`)."""
    router_cpus, load_cpus = ({1}, {0}) if pin else (None, None)
    prefills, decodes = [_free_port(), _free_port()], [_free_port(), _free_port()]
    probe = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}
    with ExitStack() as stack:

        def spawn(name: str, argv: list[str], cpus: set[int] | None) -> Child:
            child = _spawn(name, argv, cpus, logs)
            stack.callback(child.stop)
            return child

        globalkv = [sys.executable, "-m", "globalkv"]
        quiet = ["--prometheus-port", "0", "--router-log-level", "warn"]
        mocks = spawn(
            "mocks",
            [sys.executable, "-m", "bench.gateway_mocks", *map(str, prefills + decodes)],
            load_cpus,
        )
        _wait_ok(mocks, f"http://{HOST}:{decodes[0]}/generate", probe)
        targets: dict[str, tuple[int, list[int]]] = {"direct": (decodes[0], [])}

        grpc_port = _free_port()
        epp_argv = [*globalkv, "epp", "--host", HOST, "--port", str(_free_port()), *quiet]
        epp_argv += ["--grpc-host", HOST, "--grpc-port", str(grpc_port), "--policy", "round_robin"]
        epp_argv += [a for d in decodes for a in ("--worker", f"http://{HOST}:{d}")]
        epp = spawn("epp", epp_argv, router_cpus)
        endpoints = [a for d in decodes for a in ("--endpoint", f"{HOST}:{d}")]
        picker = ["--picker", f"{HOST}:{grpc_port}"]
        for name, pickers in (
            ("envoy+epp", picker),
            ("envoy+epp-headers", [*picker, "--no-stream-response"]),
            ("envoy-rr", []),
        ):
            port = _free_port()
            argv = [*globalkv, "envoy", "--port", str(port), "--admin-port", str(_free_port())]
            envoy = spawn(name, [*argv, *endpoints, *pickers], router_cpus)
            _wait_ok(envoy, f"http://{HOST}:{port}/generate", probe)
            targets[name] = (
                port,
                [envoy.popen.pid, epp.popen.pid] if pickers else [envoy.popen.pid],
            )

        port = _free_port()
        gateway = spawn(
            "gateway",
            router_argv([*globalkv, "gateway"], prefills, decodes, port) + quiet,
            router_cpus,
        )
        _wait_ok(gateway, f"http://{HOST}:{port}/generate", probe)
        targets["gateway"] = (port, [gateway.popen.pid])
        if load_cpus is not None:
            os.sched_setaffinity(0, load_cpus)
        yield targets


async def measure(
    targets: dict[str, tuple[int, list[int]]],
    concurrencies: Sequence[int],
    repeats: int,
    duration: float,
) -> dict[Key, Cell]:
    cells: dict[Key, Cell] = {}
    names = list(targets)
    for rep in range(repeats):
        for concurrency in concurrencies:
            for stream in (False, True):
                for name in names[rep % len(names) :] + names[: rep % len(names)]:
                    port, pids = targets[name]
                    before = sum(cpu_seconds(p) for p in pids)
                    result = await run_load(
                        HOST,
                        port,
                        "/generate",
                        _body(stream),
                        concurrency=concurrency,
                        duration=duration,
                    )
                    if result.errors:
                        raise RuntimeError(f"{name}: {result.errors} answers were not 200")
                    cell = cells.setdefault((name, stream, concurrency), Cell())
                    cell.runs.append(result)
                    if pids:
                        spent = sum(cpu_seconds(p) for p in pids) - before
                        cell.cpu_us.append(spent / max(result.answered, 1) * 1e6)
        print(f"repetition {rep + 1}/{repeats} done", file=sys.stderr, flush=True)
    return cells


def table(cells: dict[Key, Cell], concurrencies: Sequence[int]) -> str:
    head = ["stream", "conc", "direct req/s"]
    for name in TARGETS:
        head += [f"{name} req/s", f"{name} +p50 ms", f"{name} +p99 ms", f"{name} CPU µs/req"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for stream in (False, True):
        for c in concurrencies:
            row = [
                "on" if stream else "off",
                str(c),
                f"{cells[('direct', stream, c)].median('rps'):.0f}",
            ]
            for name in TARGETS:
                cell = cells[(name, stream, c)]
                row += [
                    f"{cell.median('rps'):.0f}",
                    f"{_added(cells, name, stream, c, 'p50') * 1000:.2f}",
                    f"{_added(cells, name, stream, c, 'p99') * 1000:.2f}",
                    f"{statistics.median(cell.cpu_us):.0f}",
                ]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.entry", description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--duration", type=float, default=2.0, help="seconds per cell")
    parser.add_argument("--concurrency", default="1,16,64", help="comma-separated")
    parser.add_argument("--no-pin", action="store_true", help="no CPU pinning")
    parser.add_argument("--output", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    pin = (os.cpu_count() or 1) >= 2 and not args.no_pin
    logs = Path(tempfile.mkdtemp(prefix="bench-entry-"))
    with _started(logs, pin) as targets:
        cells = asyncio.run(measure(targets, concurrencies, args.repeats, args.duration))
    text = table(cells, concurrencies)
    print(text)
    if args.output is not None:
        args.output.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
