"""The gateway's user-space instructions per request, counted by callgrind.

    python -m bench.gateway_instructions [--requests 2000] [--stream] [--variant LABEL=DIR …]
        [--flags LABEL=FLAGS …] [--headers LABEL=Name:Value[,Name:Value…] …] [--profile DIR]

On a shared machine a router's CPU time per request swings by tens of percent from run to
run (other tenants, frequency scaling), so a change of a few microseconds per request
cannot be told from noise by timing. Instructions executed can: the same code, inputs
and environment give the same count within about 0.5 %, whatever else the machine does.
Each gateway (this checkout's, and each `--variant` as exported into DIR from another
revision) runs under `valgrind --tool=callgrind` behind the same mock workers as
`bench.gateway` (`--policy round_robin`, its `/generate` body: 64 `input_ids`, 4 new
tokens, whole answers or with `--stream` streamed); each `--flags` runs this checkout's
gateway with those flags added (what a feature costs when it is on), and each `--headers`
names headers every request of a case carries (what a feature costs the request that uses
it): the `--flags` case of the same label, else a case of its own of this checkout's
gateway with no flags added. Flow control's cases (`--flow-control` in their flags) carry
`FLOW_HEADERS` as well;
the counters are zeroed once it has answered a warm-up, then `--requests` requests are
sent over 4 connections and the counters dumped. Instructions are not time (no cache
misses, no system calls), so read the ratios, and `bench.gateway` for requests/s.

The workers' periodic checks (health, bootstrap directories: `PERIODIC`) are set an hour
apart: their work is per second, not per request, and a run under valgrind lasts longer
the busier the machine. With them on they were about 4 % of the count, and the same
gateway counted 2.4 % apart in two runs of one invocation; with them off, within 0.2 %.

`--profile DIR` keeps each gateway's dump of the measured requests as
`DIR/callgrind.<label>.out` (the warm-up and start-up not in it), for
`callgrind_annotate` (`--inclusive=yes` for inclusive counts). Python functions show only
as the interpreter's C frames (`_PyEval_EvalFrameDefault`, the objects' methods); the C
extensions the gateway calls (httptools, orjson, uvloop) show by name.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench.gateway import PROMPT, Child, _body, _free_port, _spawn, _wait_ok, router_argv
from bench.gateway_load import read_answer, request_bytes
from bench.gateway_variant import variant

HOST = "127.0.0.1"
CONNECTIONS = 4
PERIODIC = ("--health-check-interval-secs", "3600", "--directory-refresh-secs", "3600")
"""Flags every gateway measured here accepts (an export from 2026-11-30 on does)."""
FLOW_HEADERS = (
    ("x-llm-d-inference-fairness-id", "tenant-a"),
    ("x-llm-d-inference-objective", "premium"),
)
"""What each request carries when flow control is on: a tenant and an objective."""


def _flags(value: str) -> tuple[str, list[str]]:
    label, sep, flags = value.partition("=")
    if not sep or not label or not flags.split():
        raise argparse.ArgumentTypeError(f"want LABEL=FLAGS, got {value!r}")
    return label, flags.split()


def _headers(value: str) -> tuple[str, list[tuple[str, str]]]:
    """`LABEL=Name:Value[,Name:Value…]`: a value may hold colons (an `Origin`'s URL), not
    commas."""
    label, sep, rest = value.partition("=")
    headers = []
    for item in rest.split(","):
        name, colon, text = item.partition(":")
        headers.append((name.strip(), text.strip()))
        if not colon or not name.strip() or not text.strip():
            headers = []
            break
    if not sep or not label or not headers:
        raise argparse.ArgumentTypeError(f"want LABEL=Name:Value[,Name:Value…], got {value!r}")
    return label, headers


async def _send(
    port: int, requests: int, body: bytes, headers: Sequence[tuple[str, str]] = ()
) -> None:
    payload = request_bytes(HOST, port, "/generate", body, headers)

    async def one_connection(count: int) -> None:
        reader, writer = await asyncio.open_connection(HOST, port)
        for _ in range(count):
            writer.write(payload)
            status, _ = await read_answer(reader)
            if status != 200:
                raise RuntimeError(f"the gateway answered {status}")
        writer.close()

    await asyncio.gather(*(one_connection(requests // CONNECTIONS) for _ in range(CONNECTIONS)))


def count(
    directory: str | None,
    requests: int,
    stream: bool,
    logs: Path,
    flags: Sequence[str] = (),
    headers: Sequence[tuple[str, str]] = (),
    keep: Path | None = None,
) -> float:
    """Instructions per request of the gateway in `directory` (None: this checkout's),
    given `flags` besides the usual ones, each request carrying `headers`; `keep`: where
    to copy the dump of the measured requests."""
    prefills, decodes = [_free_port(), _free_port()], [_free_port(), _free_port()]
    mocks_argv = [sys.executable, "-m", "bench.gateway_mocks", *map(str, prefills + decodes)]
    mocks = _spawn("mocks", mocks_argv, None, logs)
    out = logs / f"callgrind-{time.monotonic_ns()}.out"
    port = _free_port()
    valgrind = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
    command = [*valgrind, sys.executable, "-m", "globalkv", "gateway"]
    argv = router_argv(command, prefills, decodes, port)
    argv = [*argv, "--prometheus-port", "0", *PERIODIC, *flags]
    gateway = _spawn("gateway", argv, None, logs, directory)
    try:
        probe = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}
        _wait_ok(gateway, f"http://{HOST}:{port}/generate", probe, 600, headers)
        return measured(gateway, port, out, requests, _body(stream), headers, keep)
    finally:
        gateway.stop()
        mocks.stop()


def measured(
    child: Child,
    port: int,
    out: Path,
    requests: int,
    body: bytes,
    headers: Sequence[tuple[str, str]] = (),
    keep: Path | None = None,
) -> float:
    """Instructions per request of `child`, running under callgrind (dumping to `out`),
    for `requests` of `body` sent to `port` after a warm-up (connections, code paths),
    which the counters are zeroed after; `keep`: where to copy the dump."""
    asyncio.run(_send(port, 40, body, headers))
    pid = str(child.popen.pid)
    subprocess.run(["callgrind_control", "-z", pid], check=True, capture_output=True)
    asyncio.run(_send(port, requests, body, headers))
    subprocess.run(["callgrind_control", "-d", pid], check=True, capture_output=True)
    dump = next(out.parent.glob(f"{out.name}.*"))
    if keep is not None:
        shutil.copyfile(dump, keep)
    lines = dump.read_text().splitlines()
    summary = next(line for line in lines if line.startswith("summary:"))
    return int(summary.split()[1]) / (requests // CONNECTIONS * CONNECTIONS)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--stream", action="store_true", help="streamed answers")
    parser.add_argument("--variant", type=variant, action="append", default=[])
    parser.add_argument(
        "--flags",
        type=_flags,
        action="append",
        default=[],
        metavar="LABEL=FLAGS",
        help="this checkout's gateway with FLAGS added (repeatable)",
    )
    parser.add_argument(
        "--headers",
        type=_headers,
        action="append",
        default=[],
        metavar="LABEL=Name:Value[,Name:Value…]",
        help="headers every request carries: those of the --flags case LABEL, else of a "
        "case of this checkout's gateway with no flags added (repeatable)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="keep each gateway's callgrind dump of the measured requests in DIR",
    )
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        parser.error("needs valgrind and callgrind_control on the PATH (Debian: valgrind)")
    profile: Path | None = args.profile
    if profile is not None:
        profile.mkdir(parents=True, exist_ok=True)

    def kept(label: str) -> Path | None:
        if profile is None:
            return None
        return profile / f"callgrind.{re.sub(r'[^A-Za-z0-9_.-]+', '-', label)}.out"

    with tempfile.TemporaryDirectory(prefix="globalkv-instructions-") as logs:
        here = "this checkout"
        counts = {here: count(None, args.requests, args.stream, Path(logs), keep=kept(here))}
        for label, directory in args.variant:
            counts[label] = count(
                directory, args.requests, args.stream, Path(logs), keep=kept(label)
            )
        cases: dict[str, tuple[list[str], list[tuple[str, str]]]] = {}
        for label, flags in args.flags:
            cases[label] = (flags, list(FLOW_HEADERS) if "--flow-control" in flags else [])
        for label, headers in args.headers:
            cases.setdefault(label, ([], []))[1].extend(headers)
        for label, (flags, headers) in cases.items():
            counts[label] = count(
                None, args.requests, args.stream, Path(logs), flags, headers, kept(label)
            )
    base = counts["this checkout"]
    print("| gateway | instructions per request | ratio to this checkout |")
    print("|---|---|---|")
    for label, value in counts.items():
        print(f"| {label} | {value:,.0f} | {value / base:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
