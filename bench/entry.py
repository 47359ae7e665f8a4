"""The entry points' own cost, side by side: requests/s and added latency per way in.

    python -m bench.entry [--repeats 3] [--duration 2] [--concurrency 1,16,64] [--output FILE]

Against the instant mock workers of `bench.gateway_mocks` (answers prebuilt), measured in
one run with `bench.gateway`'s load generator and interleaved rounds (every repetition
measures every target once per cell, in rotating order; the tables give medians, the
added latency the median of per-repetition differences to the direct call):

- `direct`: one mock, no router;
- `envoy+epp`: Envoy (`globalkv envoy`, one worker thread) calling `globalkv epp` over
  ext_proc (the default: request headers and the body BUFFERED, nothing of the response),
  sending each request whole to one of two mocks (an aggregated pool, the picker's
  `round_robin` policy: what is measured is the path, not a cache);
- `envoy+epp-duplex`: the same with `--body-mode full-duplex`: the body streamed to the
  picker and back, the response's headers, body and trailers through it too (the
  picker's messages, their cost and what they buy: `bench.epp`);
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
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

from bench.gateway import (
    HOST,
    PROMPT,
    Child,
    Target,
    _free_port,
    _spawn,
    _wait_ok,
    measure,
    router_argv,
    table,
)

TARGETS = ("envoy+epp", "envoy+epp-duplex", "envoy-rr", "gateway")


@contextmanager
def _started(logs: Path, pin: bool) -> Iterator[dict[str, Target]]:
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
        targets = {"direct": Target(decodes[0], ())}

        grpc_port = _free_port()
        epp_argv = [*globalkv, "epp", "--host", HOST, "--port", str(_free_port()), *quiet]
        epp_argv += ["--grpc-host", HOST, "--grpc-port", str(grpc_port), "--policy", "round_robin"]
        epp_argv += [a for d in decodes for a in ("--worker", f"http://{HOST}:{d}")]
        epp = spawn("epp", epp_argv, router_cpus)
        endpoints = [a for d in decodes for a in ("--endpoint", f"{HOST}:{d}")]
        picker = ["--picker", f"{HOST}:{grpc_port}"]
        for name, pickers in (
            ("envoy+epp", picker),
            ("envoy+epp-duplex", [*picker, "--body-mode", "full-duplex"]),
            ("envoy-rr", []),
        ):
            port = _free_port()
            argv = [*globalkv, "envoy", "--port", str(port), "--admin-port", str(_free_port())]
            envoy = spawn(name, [*argv, *endpoints, *pickers], router_cpus)
            _wait_ok(envoy, f"http://{HOST}:{port}/generate", probe)
            pids = (envoy.popen.pid, epp.popen.pid) if pickers else (envoy.popen.pid,)
            targets[name] = Target(port, pids)

        port = _free_port()
        gateway = spawn(
            "gateway",
            router_argv([*globalkv, "gateway"], prefills, decodes, port) + quiet,
            router_cpus,
        )
        _wait_ok(gateway, f"http://{HOST}:{port}/generate", probe)
        targets["gateway"] = Target(port, (gateway.popen.pid,))
        if load_cpus is not None:
            os.sched_setaffinity(0, load_cpus)
        yield targets


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
    text = table(cells, TARGETS, concurrencies)
    print(text)
    if args.output is not None:
        args.output.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
