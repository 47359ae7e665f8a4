"""The gateway's own cost: requests/s and added latency against instant mock workers.

    python -m bench.gateway [--sglang-router-python PATH] [--repeats 5] [--output FILE]
        [--ceilings asgi,raw,proxy] [--granian rsgi,bare] [--variant LABEL=DIR …]
    python -m bench.gateway --engine vllm [--smg-python PATH] …

With `--engine vllm` the pairs are vLLM workers and the routers run in their vLLM PD modes
(`bench.gateway_vllm`). smg's columns appear, with either engine, when `--smg-python` names
an interpreter with `smg` installed: on SGLang workers smg takes sglang-router's PD flags
(`--pd-disaggregation --prefill URL BOOTSTRAP_PORT --decode URL`) with `--backend sglang`,
so one run measures globalkv, sglang-router and smg side by side.

Two prefill and two decode mocks (`bench.gateway_mocks`, answers prebuilt, one process)
sit behind each router; the load generator (`bench.gateway_load`) calls the decode mock
directly as the baseline, then each router, at every concurrency, streaming off and on.
Both routers get the same flags where they share them: `--policy round_robin`, the same
workers, warnings-only logs, no separate metrics listener in the way.

Fairness on a small machine: with two or more CPUs, each router runs alone on CPU 1
while the mocks and the load generator share CPU 0 (`os.sched_setaffinity`), so a router
never competes with the load for its core and both routers get the same core. Runs are
interleaved — every repetition measures every (concurrency, stream, target) once, the
targets' order rotating — and the tables give medians over repetitions; the added
latency is the median of the per-repetition differences to the direct call measured
in the same repetition.

The sglang-router columns appear only when `--sglang-router-python` names an interpreter
with `sglang_router` installed (it is never imported here). `--ceilings` adds the bare
servers of `bench.gateway_ceilings`, `--granian` the same gateway served by granian
(`bench.gateway_granian`); `--variant LABEL=DIR` adds the gateway as exported
into DIR from an older revision, so before and after are measured in the same runs.

"CPU µs/req" is the router process's CPU time (all threads, from /proc) over the run
divided by the answers it gave: on a shared machine a router's requests/s also depend on
how much of its core other processes leave it, its CPU per request does not. In brackets,
the kernel's part of it (system calls, and the loopback deliveries they cause, charged to
the writer): every router reads and writes at least the client's request and answer and
one request and answer per worker called, so the part outside the brackets is the one
its own code decides.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench import gateway_vllm
from bench.gateway_load import RunResult, run_load
from bench.gateway_variant import variant
from kvplumbing.ports import unclaimed_ports

HOST = "127.0.0.1"
PROMPT = list(range(1000, 1064))


def _free_port() -> int:
    return unclaimed_ports(1)[0]


@dataclass
class Child:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, 15)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, 9)
                self.popen.wait(10)


def _spawn(
    name: str,
    argv: Sequence[str],
    cpus: set[int] | None,
    logs: Path,
    cwd: str | None = None,
) -> Child:
    log = logs / f"{name}.log"
    with log.open("wb") as out:
        popen = subprocess.Popen(
            list(argv), stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd
        )
    if cpus is not None:
        os.sched_setaffinity(popen.pid, cpus)
    return Child(name, popen, log)


def _wait_ok(
    child: Child,
    url: str,
    body: Mapping[str, object],
    timeout: float = 60.0,
    headers: Sequence[tuple[str, str]] = (),
) -> None:
    """Until a request through `url` carrying `headers` answers 200 (workers adopted, routes
    live; with `--api-key`, only a request that carries the key is answered 200)."""
    deadline = time.monotonic() + timeout
    while True:
        if child.popen.poll() is not None:
            raise RuntimeError(f"{child.name} exited:\n{child.log.read_text(errors='replace')}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.post(url, json=body, headers=list(headers), timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{child.name} not serving {url}; log: {child.log}")
        time.sleep(0.1)


def router_argv(
    command: Sequence[str], prefills: Sequence[int], decodes: Sequence[int], port: int
) -> list[str]:
    """sglang-router's PD flags, which `globalkv gateway` accepts as they are."""
    argv = [*command, "--pd-disaggregation", "--host", HOST, "--port", str(port)]
    for p in prefills:
        argv += ["--prefill", f"http://{HOST}:{p}", str(p)]
    for d in decodes:
        argv += ["--decode", f"http://{HOST}:{d}"]
    return [*argv, "--policy", "round_robin"]


@dataclass(frozen=True)
class Target:
    port: int
    pids: tuple[int, ...]
    """The router's processes, whose CPU time is read around each run (none: not measured)."""


def cpu_times(pid: int) -> tuple[float, float]:
    """User and system CPU time of a process, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process together."""
    return sum(cpu_times(pid))


@dataclass
class Cell:
    """One (target, stream, concurrency): a result per repetition."""

    runs: list[RunResult] = field(default_factory=list)
    cpu_us: list[float] = field(default_factory=list)
    """The target's CPU microseconds per answer, per repetition."""
    sys_us: list[float] = field(default_factory=list)
    """Of those, the kernel's (system calls, and loopback TCP charged to the sender)."""

    def median(self, what: str) -> float:
        return statistics.median(float(getattr(r, what)) for r in self.runs)


Key = tuple[str, bool, int]


def _body(stream: bool) -> bytes:
    return json.dumps(
        {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}, "stream": stream}
    ).encode()


async def measure(
    targets: dict[str, Target],
    concurrencies: Sequence[int],
    repeats: int,
    duration: float,
    vllm: bool = False,
) -> dict[Key, Cell]:
    path = gateway_vllm.PATH if vllm else "/generate"
    make_body = gateway_vllm.body if vllm else _body
    cells: dict[Key, Cell] = {}
    names = list(targets)
    for rep in range(repeats):
        for concurrency in concurrencies:
            for stream in (False, True):
                order = names[rep % len(names) :] + names[: rep % len(names)]
                for name in order:
                    target = targets[name]
                    before = [cpu_times(pid) for pid in target.pids]
                    result = await run_load(
                        HOST,
                        target.port,
                        path,
                        make_body(stream),
                        concurrency=concurrency,
                        duration=duration,
                    )
                    if result.errors:
                        raise RuntimeError(f"{name}: {result.errors} answers were not 200")
                    cell = cells.setdefault((name, stream, concurrency), Cell())
                    cell.runs.append(result)
                    if target.pids:
                        after = [cpu_times(pid) for pid in target.pids]
                        user = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
                        kernel = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
                        answered = max(result.answered, 1)
                        cell.cpu_us.append((user + kernel) / answered * 1e6)
                        cell.sys_us.append(kernel / answered * 1e6)
        print(f"repetition {rep + 1}/{repeats} done", file=sys.stderr, flush=True)
    return cells


def _added(cells: dict[Key, Cell], name: str, stream: bool, c: int, what: str) -> float:
    target, direct = cells[(name, stream, c)].runs, cells[("direct", stream, c)].runs
    return statistics.median(
        float(getattr(t, what) - getattr(d, what)) for t, d in zip(target, direct, strict=True)
    )


def table(cells: dict[Key, Cell], routers: Sequence[str], concurrencies: Sequence[int]) -> str:
    head = ["stream", "conc", "direct req/s"]
    for r in routers:
        head += [f"{r} req/s", f"{r} +p50 ms", f"{r} +p99 ms", f"{r} CPU µs/req (sys)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for stream in (False, True):
        for c in concurrencies:
            row = [
                "on" if stream else "off",
                str(c),
                f"{cells[('direct', stream, c)].median('rps'):.0f}",
            ]
            for r in routers:
                cell = cells[(r, stream, c)]
                row += [
                    f"{cell.median('rps'):.0f}",
                    f"{_added(cells, r, stream, c, 'p50') * 1000:.2f}",
                    f"{_added(cells, r, stream, c, 'p99') * 1000:.2f}",
                    _cpu(cell),
                ]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _cpu(cell: Cell) -> str:
    if not cell.cpu_us:
        return "-"
    return f"{statistics.median(cell.cpu_us):.0f} ({statistics.median(cell.sys_us):.0f})"


@contextlib.contextmanager
def cluster(args: argparse.Namespace, logs: Path) -> Iterator[dict[str, Target]]:
    pin = (os.cpu_count() or 1) >= 2 and not args.no_pin
    router_cpus, load_cpus = ({1}, {0}) if pin else (None, None)
    prefills, decodes = [_free_port(), _free_port()], [_free_port(), _free_port()]
    vllm = args.engine == "vllm"
    ports = (
        gateway_vllm.mock_ports(prefills, decodes) if vllm else list(map(str, prefills + decodes))
    )
    endpoint = gateway_vllm.PATH if vllm else "/generate"
    children: list[Child] = []
    try:
        mocks_argv = [sys.executable, "-m", "bench.gateway_mocks", *ports]
        mocks = _spawn("mocks", mocks_argv, load_cpus, logs)
        children.append(mocks)
        probe: dict[str, object] = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}
        if vllm:
            probe = json.loads(gateway_vllm.body(False, 1))
        _wait_ok(mocks, f"http://{HOST}:{decodes[0]}{endpoint}", probe)
        targets = {"direct": Target(decodes[0], ())}
        ours = [sys.executable, "-m", "globalkv", "gateway"]
        ours_flags = ["--prometheus-port", "0", "--router-log-level", "warn"]
        # (command, flags, working directory): `python -m` puts the working directory
        # first on sys.path, so a variant's gateway/ is found before the installed one.
        routers: dict[str, tuple[list[str], list[str], str | None]] = {
            "globalkv": (ours, ours_flags, None)
        }
        for label, path in args.variant:
            routers[label] = (ours, ours_flags, path)
        if args.sglang_router_python and not vllm:
            command = [args.sglang_router_python, "-m", "sglang_router.launch_router"]
            extra = ["--prometheus-port", str(_free_port()), "--log-level", "warn"]
            routers["sglang-router"] = (command, extra, None)
        if args.smg_python:
            command = [args.smg_python, "-m", "smg.launch_router"]
            extra = ["--prometheus-port", str(_free_port()), "--log-level", "warn"]
            if not vllm:  # smg's default, named so the mode is explicit (smg_argv: vllm)
                extra += ["--backend", "sglang"]
            routers["smg"] = (command, extra, None)
        for mode in args.granian:
            granian = [sys.executable, "-m", "bench.gateway_granian", mode]
            routers[f"granian-{mode}"] = (granian, ours_flags, None)
        for mode in args.ceilings:
            ceiling = [sys.executable, "-m", "bench.gateway_ceilings", mode]
            routers[f"{mode}-ceiling"] = (ceiling, [], None)
        for name, (command, extra, cwd) in routers.items():
            port = _free_port()
            plan = router_argv
            if vllm:
                plan = gateway_vllm.smg_argv if name == "smg" else gateway_vllm.globalkv_argv
            argv = plan(command, prefills, decodes, port) + extra
            child = _spawn(name, argv, router_cpus, logs, cwd)
            children.append(child)
            _wait_ok(child, f"http://{HOST}:{port}{endpoint}", probe)
            targets[name] = Target(port, (child.popen.pid,))
        if load_cpus is not None:
            os.sched_setaffinity(0, load_cpus)
        yield targets
    finally:
        for child in reversed(children):
            child.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway", description=__doc__)
    parser.add_argument("--sglang-router-python", help="interpreter with sglang_router")
    parser.add_argument(
        "--engine",
        choices=["sglang", "vllm"],
        default="sglang",
        help="the workers' PD protocol (vllm: vLLM mocks, routers in vLLM PD mode)",
    )
    parser.add_argument("--smg-python", help="interpreter with smg")
    parser.add_argument("--concurrency", default="1,16,64", help="comma-separated levels")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repetitions")
    parser.add_argument("--duration", type=float, default=2.0, help="seconds per run")
    parser.add_argument(
        "--ceilings",
        type=lambda v: [m for m in v.split(",") if m],
        default=[],
        help="also measure these bench.gateway_ceilings modes (comma-separated: asgi,raw,proxy)",
    )
    parser.add_argument(
        "--granian",
        type=lambda v: [m for m in v.split(",") if m],
        default=[],
        help="also measure the gateway served by granian in these bench.gateway_granian modes "
        "(comma-separated: rsgi,rsgi-rust,rsgi-nodisconnect,bare)",
    )
    parser.add_argument(
        "--variant",
        type=variant,
        action="append",
        default=[],
        metavar="LABEL=DIR",
        help="also measure `globalkv gateway` run from DIR, whose gateway/ (e.g. an older one, "
        "`git archive REV gateway | tar -x -C DIR`) is then imported first; repeatable",
    )
    parser.add_argument("--no-pin", action="store_true", help="do not pin CPUs")
    parser.add_argument("--output", type=Path, help="also write the Markdown table here")
    parser.add_argument("--logs", type=Path, default=Path("/tmp/globalkv-bench-gateway"))
    args = parser.parse_args(argv)
    if args.sglang_router_python and not Path(args.sglang_router_python).is_file():
        print(f"no interpreter at {args.sglang_router_python}: sglang-router skipped")
        args.sglang_router_python = None
    if args.smg_python and not Path(args.smg_python).is_file():
        print(f"no interpreter at {args.smg_python}: smg skipped")
        args.smg_python = None
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    args.logs.mkdir(parents=True, exist_ok=True)
    import uvloop

    with cluster(args, args.logs) as targets:
        cells = uvloop.run(
            measure(targets, concurrencies, args.repeats, args.duration, args.engine == "vllm")
        )
    routers = [name for name in targets if name != "direct"]
    pinned = (
        "routers on CPU 1, mocks and load on CPU 0"
        if (os.cpu_count() or 1) >= 2 and not args.no_pin
        else "not pinned"
    )
    text = (
        f"{table(cells, routers, concurrencies)}\n\n"
        f"Medians of {args.repeats} interleaved repetitions of {args.duration:g} s per cell; "
        f"+p50/+p99: latency added over calling the decode mock directly; {pinned}.\n"
    )
    print(text)
    if args.output:
        args.output.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
