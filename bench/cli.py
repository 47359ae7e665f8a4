"""`globalkv bench`: benchmarks run as commands. `globalkv bench replay` replays a trace.

    globalkv bench replay --trace bench/replay/traces/mooncake_conversation_trace.jsonl.xz \\
        --policies prefix,cache_aware,least_load,random --out bench/results/mooncake.json

Flags are read here only and become one `ReplaySettings`; cluster values left unset are
derived from the trace (see `bench.replay.config`). The gateway's own flag names are kept
for the policy parameters (`--prefix-queued-weight`, `--cache-threshold`, …).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shlex
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, cast, get_args

from bench.replay.config import ALL_POLICIES, DEFAULT_POLICIES, ReplaySettings
from bench.replay.sweep import SWEEPABLE, Sweep
from bench.replay.trace import TraceError
from gateway.settings.base import PolicyName, optional_float
from globalkv.extras import require
from kvplumbing.validation import validation_as_value_error

if TYPE_CHECKING:
    from bench.replay.record import Progress

_CLUSTER = {
    "pods": int,
    "decode_pods": int,
    "capacity_blocks": int,
    "capacity_fraction": float,
    "prefill_tokens_per_s": float,
    "utilisation": float,
    "max_batch_tokens": int,
    "decode_tokens_per_s": float,
    "event_delay_s": float,
}
_PREFIX = {
    "uncached_weight": float,
    "queued_weight": float,
    "request_cost": float,
    "pressure_weight": float,
}
_CACHE_AWARE = {
    "cache_threshold": float,
    "balance_abs_threshold": int,
    "balance_rel_threshold": float,
    "eviction_interval_secs": float,
    "max_tree_size": int,
}


LIVE_MAX_OUTPUT_TOKENS = 16
"""Live mode's default output cap (see `ReplaySettings.max_output_tokens`)."""


def _optional_number(text: str) -> float:
    """A finite number, or NaN for "none"/"off" (the flag given, its feature disabled)."""
    value = optional_float(text)
    if value is None:
        return math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r}: give a finite number, or 'off'")
    return value


def register(subparsers: Any) -> None:
    bench: argparse.ArgumentParser = subparsers.add_parser(
        "bench", help="benchmarks; `bench replay` measures routing policies on a trace"
    )
    commands = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    parser: argparse.ArgumentParser = commands.add_parser(
        "replay",
        help="replay a Mooncake-format trace against the gateway's routing policies",
        description="Replay a Mooncake-format JSONL trace (simulated pods, or a live local "
        "stack) against the gateway's own routing policies; writes JSON, Markdown and PNGs.",
    )
    add = parser.add_argument
    add("--trace", required=True, help="Mooncake-format JSONL (.jsonl, .gz or .xz)")
    add("--mode", choices=["sim", "live"], default="sim", help="simulate, or run a live stack")
    add("--pods", type=int, help="prefill pods (16)")
    add("--decode-pods", type=int, help="decode pods (= --pods)")
    add("--capacity-blocks", type=int, help="KV capacity per prefill pod, in blocks")
    add("--capacity-fraction", type=float, help="unset capacity: share of unique blocks (0.2)")
    add("--block-size", type=int, help="tokens per hash id (inferred from the trace)")
    add("--policies", default=",".join(DEFAULT_POLICIES), help="comma-separated, or 'all'")
    add("--time-scale", type=float, default=1.0, help="wall seconds per trace second")
    add(
        "--engine",
        choices=["sglang", "vllm"],
        help="live: the engines' PD protocol (default sglang; vllm: requests on /v1/completions)",
    )
    add("--limit", type=int, help="replay the first N requests")
    add("--out", help="JSON output (default replay-<trace>[-live].json); .md and .png beside")
    add("--prefill-tokens-per-s", type=float, help="per pod (default: from --utilisation)")
    add("--utilisation", type=float, help="no-cache busy share setting the rate (0.7)")
    add("--prefill-overhead-ms", type=float, help="fixed cost per prefill (5)")
    add("--max-batch-tokens", type=int, help="prefill tokens per step (8192)")
    add("--attention-tokens", type=_optional_number, help="superlinear attention; none: off")
    add("--decode-tokens-per-s", type=float, help="output tokens/s per request (30)")
    add("--kv-transfer-tokens-per-s", type=_optional_number, help="none: no transfer time")
    add("--event-delay-s", type=float, help="KV event to index visibility (0.01)")
    add("--arrivals", choices=["spread", "burst"], help="equal timestamps spread or bursts")
    add("--seed", type=int, help="seed of every policy's RNG (0)")
    add("--vocab", type=int, help="token ids are drawn below this (256)")
    add("--model", help="model name keyed in the index")
    add("--max-output-tokens", type=int, help=f"cap per request (live: {LIVE_MAX_OUTPUT_TOKENS})")
    add("--decode-policy", choices=list(get_args(PolicyName)), help="(power_of_two)")
    for name in _PREFIX:
        add(f"--prefix-{name.replace('_', '-')}", type=_PREFIX[name], help="gateway flag")
    add(
        "--prefix-pending-grace-secs",
        type=_optional_number,
        help="gateway flag, in trace seconds (scaled by --time-scale like every time); off: none",
    )
    for name in _CACHE_AWARE:
        add(f"--{name.replace('_', '-')}", type=_CACHE_AWARE[name], help="gateway flag")
    add(
        "--sessions",
        action="store_true",
        help="name each request's conversation as a session header would (derived from the "
        "trace: the block after the shared first one)",
    )
    add(
        "--session-ttl-secs",
        type=_optional_number,
        help="gateway flag, in trace seconds: a session's idle time to live (600); off: none",
    )
    add("--run-dir", help="live: the stacks' logs, one directory per policy (default runs/)")
    add("--sweep", help=f"NAME=V1,V2,… with NAME in {', '.join(sorted(SWEEPABLE))}")
    add("--bucket-s", type=float, help="hit-rate-over-time bucket width (60)")
    add("--gateways", type=int, help="gateway replicas the requests are split over (1)")
    add(
        "--entry",
        choices=["gateway", "envoy"],
        help="live: requests through the gateway, or Envoy with pickers and sidecars (gateway)",
    )
    add("--gateway-sharing", choices=["none", "shared"], help="what replicas share (shared)")
    add("--share-interval-s", type=float, help="replicas' publication interval, trace s (0.1)")
    add(
        "--pd-decider",
        choices=["always", "local-when-faster", "isl-bounding"],
        help="disaggregate always (default), when the gateway's decider says, or by "
        "Dynamo's isl_bounding rule (sim only)",
    )
    add("--pd-decider-itl-weight", type=float, help="gateway flag (1)")
    add("--no-oracle", action="store_true", help="skip the pooled LRU and Belady lines")
    add("--no-plots", action="store_true", help="write no PNG")
    add("--quiet", action="store_true", help="no progress on stderr")
    parser.set_defaults(run=run, check_config=check_config)


def _policies(text: str) -> tuple[PolicyName, ...]:
    names = (
        ALL_POLICIES
        if text.strip() == "all"
        else tuple(n.strip() for n in text.split(",") if n.strip())
    )
    unknown = [n for n in names if n not in ALL_POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; choose from {', '.join(ALL_POLICIES)}")
    return cast(tuple[PolicyName, ...], names)


def _given(args: argparse.Namespace, names: Mapping[str, type], prefix: str = "") -> dict[str, Any]:
    return {n: getattr(args, prefix + n) for n in names if getattr(args, prefix + n) is not None}


def build_settings(args: argparse.Namespace) -> tuple[ReplaySettings, Sweep | None]:
    """The typed settings of `bench replay`; `ValueError` says which flag is wrong."""
    cluster = _given(args, _CLUSTER)
    if args.prefill_overhead_ms is not None:
        cluster["prefill_overhead_s"] = args.prefill_overhead_ms / 1000
    for name in ("attention_tokens", "kv_transfer_tokens_per_s"):
        value = getattr(args, name)
        if value is not None:
            cluster[name] = None if math.isnan(value) else value
    if args.mode == "live":
        cluster.setdefault("kv_transfer_tokens_per_s", None)
    top: dict[str, Any] = {
        "trace": args.trace,
        "mode": args.mode,
        "policies": _policies(args.policies),
        "time_scale": args.time_scale,
        "oracle": not args.no_oracle,
    }
    names: tuple[str, ...] = ("block_size", "limit", "arrivals", "seed", "vocab", "model")
    names += ("bucket_s", "run_dir", "engine", "gateways", "gateway_sharing", "share_interval_s")
    names += ("entry",)
    names += ("pd_decider", "pd_decider_itl_weight")
    for name in names:
        if getattr(args, name) is not None:
            top[name] = getattr(args, name)
    if args.max_output_tokens is not None:
        top["max_output_tokens"] = args.max_output_tokens
    elif args.mode == "live":
        top["max_output_tokens"] = LIVE_MAX_OUTPUT_TOKENS
    if args.decode_policy is not None:
        top["decode_policy"] = args.decode_policy
    prefix = _given(args, _PREFIX, "prefix_")
    if args.prefix_pending_grace_secs is not None:
        grace = args.prefix_pending_grace_secs
        prefix["pending_grace_secs"] = None if math.isnan(grace) else grace
    if args.session_ttl_secs is not None:
        ttl = args.session_ttl_secs
        prefix["session_ttl_secs"] = None if math.isnan(ttl) else ttl
    if args.sessions:
        top["sessions"] = True
    with validation_as_value_error():
        settings = ReplaySettings(
            **top,
            cluster=cluster,
            prefix=prefix,
            cache_aware=_given(args, _CACHE_AWARE),
        )
    sweep = Sweep.parse(args.sweep) if args.sweep else None
    if sweep is not None:
        for value in sweep.values:
            sweep.apply(settings, value)
    return settings, sweep


def check_config(args: argparse.Namespace) -> None:
    # numpy carries the simulation; matplotlib only draws the plots.
    plotting = [] if args.no_plots else ["matplotlib"]
    require("globalkv bench replay", "bench", "numpy", *plotting)
    build_settings(args)


class ProgressLine:
    """Progress on stderr: one rewritten line on a terminal, a line per fifth otherwise."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._tty = stream.isatty()
        self._last: tuple[str, int] = ("", -1)

    def __call__(self, p: Progress) -> None:
        text = (
            f"{p.policy}: {p.done:,}/{p.total:,} requests, trace time {p.trace_time_s:,.0f} s, "
            f"{p.wall_s:.1f} s"
        )
        if self._tty:
            end = "\n" if p.done == p.total else ""
            self._stream.write(f"\r\033[K{text}{end}")
        else:
            fifth = p.done * 5 // max(p.total, 1)
            if (p.policy, fifth) == self._last:
                return
            self._last = (p.policy, fifth)
            self._stream.write(text + "\n")
        self._stream.flush()


def _out_path(settings: ReplaySettings, out: str | None) -> Path:
    if out:
        return Path(out)
    stem = Path(settings.trace).name.split(".")[0]
    return Path(f"replay-{stem}{'-live' if settings.mode == 'live' else ''}.json")


def run(args: argparse.Namespace) -> int:
    from bench.replay.plots import write_plots
    from bench.replay.report import markdown, to_json
    from bench.replay.runner import run_replay

    try:
        settings, sweep = build_settings(args)
    except ValueError as exc:
        print(f"globalkv bench replay: {exc}", file=sys.stderr)
        return 2
    # One INFO line per live request would bury the progress and the table.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    started = time.perf_counter()
    try:
        replay = run_replay(
            settings, sweep=sweep, progress=None if args.quiet else ProgressLine(sys.stderr)
        )
    except TraceError as exc:
        print(f"globalkv bench replay: {exc}", file=sys.stderr)
        return 2
    out = _out_path(settings, args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = to_json(replay, command="globalkv " + shlex.join(sys.argv[1:]))
    doc["wall_s"] = time.perf_counter() - started
    out.write_text(json.dumps(doc, indent=1, allow_nan=True) + "\n")
    plots = [] if args.no_plots else write_plots(replay, out.with_suffix(""))
    table = markdown(replay, plots=plots)
    out.with_suffix(".md").write_text(table)
    print(table)
    print(f"wrote {out}, {out.with_suffix('.md')}" + "".join(f", {p}" for p in plots))
    return 0
