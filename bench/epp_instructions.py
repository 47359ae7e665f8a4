"""The endpoint picker's user-space instructions per request, beside the minimal server's,
counted by callgrind.

    python -m bench.epp_instructions [--requests 1000] [--modes buffered,…]
        [--variant LABEL=DIR …] [--profile DIR]

`bench.epp` times the picker against `bench.epp_minimal` (the same messages answered the
same way, no picking); on a shared machine those times swing by tens of percent between
runs, so a change of a few per cent cannot be told from noise by timing, and a run beside
other work says little. Instructions can: each server (this checkout's `globalkv epp`,
each `--variant`'s picker as exported into DIR, the minimal server on each of its
transports) runs under `valgrind --tool=callgrind` — every thread, gRPC's included —
behind its own Envoy (`globalkv envoy`, not counted) in each processing mode of `--modes`
(`bench.epp.MODES`), in front of the same two `bench.gateway_mocks` workers (`--policy
round_robin`: the path is measured, not a cache); the counters are zeroed once it has
answered a warm-up, then `--requests` whole answers of `/generate` with 64 `input_ids` are
sent over 4 connections and the counters dumped. The picker's periodic checks of its
workers are set an hour apart, as `bench.gateway_instructions` sets the gateway's: under
callgrind a request takes ~50× longer, and work per second would be counted as work per
request. Envoy's health checks of the server (every half second) are answered by both
servers alike and counted. Instructions are not time (no cache misses, no system calls, no
waiting for the GIL): read the ratios, and `bench.epp` for CPU time.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

from bench.epp import MINIMAL, MINIMAL_H2, MINIMALS, MODES
from bench.gateway import HOST, PROMPT, Child, _body, _free_port, _spawn, _wait_ok
from bench.gateway_instructions import PERIODIC, measured
from bench.gateway_variant import variant


def count(
    label: str,
    directory: str | None,
    mode: str,
    requests: int,
    logs: Path,
    keep: Path | None = None,
) -> float:
    """Instructions per request of the server `label` names (`MINIMAL`, else a picker: this
    checkout's, or from `directory` when given) behind an Envoy in `mode`; its processes'
    logs named by `label` and `mode`."""
    mocks = [_free_port(), _free_port()]
    endpoints = [f"{HOST}:{m}" for m in mocks]
    probe = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{mode}.{label}")
    out = logs / f"callgrind-{time.monotonic_ns()}.out"
    valgrind = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
    grpc = _free_port()
    if label in MINIMALS:
        argv = [*valgrind, sys.executable, "-m", "bench.epp_minimal"]
        argv += ["--transport", MINIMALS[label], str(grpc), *endpoints]
    else:
        argv = [*valgrind, sys.executable, "-m", "globalkv", "epp", "--host", HOST]
        argv += ["--port", str(_free_port()), "--prometheus-port", "0"]
        argv += ["--router-log-level", "warn", "--policy", "round_robin"]
        argv += ["--grpc-host", HOST, "--grpc-port", str(grpc)]
        argv += [a for m in mocks for a in ("--worker", f"http://{HOST}:{m}")]
        argv += PERIODIC
    port = _free_port()
    envoy_argv = [sys.executable, "-m", "globalkv", "envoy", "--port", str(port)]
    envoy_argv += ["--admin-port", str(_free_port()), "--picker", f"{HOST}:{grpc}"]
    envoy_argv += [a for e in endpoints for a in ("--endpoint", e)]
    with ExitStack() as started:

        def spawn(what: str, argv: list[str], cwd: str | None = None) -> Child:
            child = _spawn(f"{what}.{name}", argv, None, logs, cwd)
            started.callback(child.stop)
            return child

        spawn("mocks", [sys.executable, "-m", "bench.gateway_mocks", *map(str, mocks)])
        counted = spawn("server", argv, directory)
        envoy = spawn("envoy", [*envoy_argv, *MODES[mode]])
        _wait_ok(envoy, f"http://{HOST}:{port}/generate", probe, 600)
        return measured(counted, port, out, requests, _body(False), keep=keep)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--modes", default="buffered", help=f"comma-separated, of {list(MODES)}")
    parser.add_argument("--variant", type=variant, action="append", default=[])
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="keep each server's callgrind dump of the measured requests in DIR",
    )
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown --modes {unknown}: choose from {list(MODES)}")
    servers: list[tuple[str, str | None]] = [("epp", None), *args.variant]
    servers += [(label, None) for label in MINIMALS]
    if len({label for label, _ in servers}) < len(servers):
        parser.error(f"--variant labels must differ from each other, epp and {list(MINIMALS)}")
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        parser.error("needs valgrind and callgrind_control on the PATH (Debian: valgrind)")
    profile: Path | None = args.profile
    if profile is not None:
        profile.mkdir(parents=True, exist_ok=True)

    print("| mode | server | instructions per request | to minimal (grpc.aio) | to minimal (h2) |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="globalkv-epp-instructions-") as logs:
        for mode in modes:
            counts = {}
            for label, directory in servers:
                keep = None
                if profile is not None:
                    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{mode}.{label}")
                    keep = profile / f"callgrind.{name}.out"
                counts[label] = count(label, directory, mode, args.requests, Path(logs), keep)
            for label, value in counts.items():
                to_aio, to_h2 = value / counts[MINIMAL], value / counts[MINIMAL_H2]
                print(f"| {mode} | {label} | {value:,.0f} | {to_aio:.3f} | {to_h2:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
