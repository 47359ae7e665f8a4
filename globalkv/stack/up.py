"""`globalkv up`: a whole local cluster in one command, supervised until Ctrl-C.

    globalkv up [--prefill 2] [--decode 2] [--gateways 1] [--indexers 1] [--port 8000]
        [--redis-url URL | --redis-cluster N] [--run-dir D]
        [--model M] [--block-size 16] [--tokenizer byte|PATH] [--policy prefix]
        [--kv-capacity PAGES] [--prefill-args="--prefill-tokens-per-s 5000"]
        [--decode-args=…] [--gateway-args=…] [--indexer-args=…] [--admin-token T | --insecure]

No Docker and no Redis needed: the indexer keeps its index in memory unless `--redis-url`
is given, or `--redis-cluster N`, which starts a local Redis Cluster of N masters with a
replica each (redis-server processes, nothing saved) and prints its seed URL. Once
everything is ready it prints every component with its address and the requests to try,
then watches the processes: a component that dies is reported with the tail of its log,
and SIGINT or SIGTERM stops everything and exits 0. Every flag also reads
`GLOBALKV_UP_<FLAG>`.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from globalkv.stack.cluster import ClusterError, LocalCluster
from globalkv.stack.config import StackConfig
from globalkv.stack.plan import check_plan, plan_stack, ports_needed
from globalkv.stack.preflight import PreflightError, preflight
from globalkv.stack.redis_cluster import ClusterStartError, LocalRedisCluster
from globalkv.stack.render import curl_lines, table
from kvplumbing.validation import validation_as_value_error

POLICIES = ["prefix", "cache_aware", "power_of_two", "round_robin", "random", "least_load"]
_SUPERVISE_SECONDS = 0.5


def register(subparsers: Any) -> None:
    defaults = StackConfig()
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "up",
        help="start a complete local cluster (indexer, engines, gateway) and supervise it",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--prefill", type=int, default=defaults.prefill, help="prefill engines")
    add("--decode", type=int, default=defaults.decode, help="decode engines")
    add("--gateways", type=int, default=defaults.gateways, help="gateways, on ports from --port")
    add(
        "--indexers",
        type=int,
        default=defaults.indexers,
        help="indexers; more than one share the pods by leases (needs --redis-url)",
    )
    add(
        "--entry",
        choices=["gateway", "envoy"],
        default=defaults.entry,
        help="how requests enter: the gateway, or Envoy with globalkv epp (--gateways "
        "replicas) and a globalkv sidecar per decode (needs the envoy extra)",
    )
    add("--port", type=int, default=8000, help="gateway port (0: a free one)")
    add("--host", default=defaults.host, help="address the gateway and the index API listen on")
    add("--redis-url", help="keep the index in this Redis (default: in memory)")
    add(
        "--redis-cluster",
        type=int,
        metavar="N",
        help="start a local Redis Cluster of N masters (and a replica each) for the index",
    )
    add("--run-dir", type=Path, help="logs and cluster.json (default: a new runs/up-… dir)")
    add("--model", default=defaults.model, help="served model name")
    add(
        "--engine",
        choices=["sglang", "vllm"],
        default=defaults.engine,
        help="PD protocol of the emulated engines (default: sglang)",
    )
    add("--block-size", type=int, default=defaults.block_size, help="page and block size")
    add("--tokenizer", default=defaults.tokenizer, help="'byte', tokenizer.json or model dir")
    add("--policy", choices=POLICIES, help="the gateway's prefill policy (default: prefix)")
    add("--kv-capacity", type=int, help="KV pages per prefill DP rank")
    for role, whom in (
        ("prefill", "every prefill engine"),
        ("decode", "every decode engine"),
        ("gateway", "the gateway"),
        ("indexer", "the indexer"),
    ):
        add(
            f"--{role}-args",
            action="append",
            default=[],
            metavar="ARGS",
            help=f"extra flags for {whom}, as one string (repeatable); they override up's",
        )
    add(
        "--health-check-interval",
        type=float,
        default=defaults.health_check_interval,
        help="seconds between the gateway's health checks",
    )
    add("--start-timeout", type=float, default=defaults.start_timeout, help="seconds")
    add(
        "--admin-token",
        help="one admin token for the indexer, the gateway and every directory, passed to "
        "them through their environment (default: none, changes only from this machine)",
    )
    add(
        "--insecure",
        action="store_true",
        help="without --admin-token, let any host change every component",
    )
    parser.set_defaults(run=run, check_config=check_config)


def _split(values: list[str]) -> list[str]:
    return [token for value in values for token in shlex.split(value)]


def config_from_args(args: argparse.Namespace) -> StackConfig:
    prefill_args = _split(args.prefill_args)
    gateway_args = _split(args.gateway_args)
    if args.kv_capacity is not None:
        prefill_args = ["--kv-capacity", str(args.kv_capacity), *prefill_args]
    if args.policy is not None:
        gateway_args = ["--prefill-policy", args.policy, *gateway_args]
    with validation_as_value_error():
        return StackConfig(
            prefill=args.prefill,
            decode=args.decode,
            gateways=args.gateways,
            entry=args.entry,
            indexers=args.indexers,
            host=args.host,
            gateway_port=args.port,
            redis_url=args.redis_url,
            redis_cluster=args.redis_cluster,
            run_dir=args.run_dir,
            model=args.model,
            engine=args.engine,
            block_size=args.block_size,
            tokenizer=args.tokenizer,
            log_level=args.log_level,
            health_check_interval=args.health_check_interval,
            start_timeout=args.start_timeout,
            prefill_args=prefill_args,
            decode_args=_split(args.decode_args),
            gateway_args=gateway_args,
            indexer_args=_split(args.indexer_args),
            admin_token=args.admin_token,
            insecure=args.insecure,
        )


def check_config(args: argparse.Namespace) -> None:
    """The stack's settings and every component's planned arguments, with stand-in ports."""
    config = config_from_args(args)
    if config.redis_cluster is not None:
        config = config.model_copy(update={"redis_url": "redis+cluster://127.0.0.1:7000/"})
    stand_in = iter(range(20000, 20000 + ports_needed(config)))
    check_plan(plan_stack(config, stand_in, args.run_dir or Path("runs")))


class _Interrupted(Exception):
    pass


@contextmanager
def _signals(handler: Callable[[int, FrameType | None], None]) -> Iterator[None]:
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise _Interrupted(signal.Signals(signum).name)


def _ignore(signum: int, frame: FrameType | None) -> None:
    """While stopping, a second Ctrl-C must not abandon children half-stopped."""


def supervise(cluster: LocalCluster, out: TextIO) -> int:
    """Report each death as it happens; returns 1 once every component has exited.

    A signal ends it earlier, by the exception its handler raises.
    """
    while True:
        time.sleep(_SUPERVISE_SECONDS)
        for death in cluster.deaths():
            print(f"globalkv up: {death.describe()}", file=out, flush=True)
        if not any(c.alive for c in cluster.components):
            print("globalkv up: every component has exited", file=out, flush=True)
            return 1


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"globalkv up: invalid configuration: {exc}", file=sys.stderr)
        return 2
    # The readiness polls would flood the terminal with one line per request.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    out = sys.stdout
    try:
        with _redis_cluster(config, out) as with_redis:
            return _run(with_redis, out)
    except ClusterStartError as exc:
        print(f"globalkv up: could not start the Redis Cluster: {exc}", file=sys.stderr)
        return 1


@contextmanager
def _redis_cluster(config: StackConfig, out: TextIO) -> Iterator[StackConfig]:
    """`config` as given, or with the URL of the Redis Cluster started for it."""
    if config.redis_cluster is None:
        yield config
        return
    redis = LocalRedisCluster(masters=config.redis_cluster, replicas=1)
    print(
        f"globalkv up: starting a Redis Cluster of {config.redis_cluster} masters…",
        file=out,
        flush=True,
    )
    redis.start()
    try:
        print(f"globalkv up: Redis Cluster seed URL {redis.url}", file=out, flush=True)
        yield config.model_copy(update={"redis_url": redis.url})
    finally:
        redis.stop()


def _run(config: StackConfig, out: TextIO) -> int:
    try:
        preflight(config)
    except PreflightError as exc:
        print(f"globalkv up: {exc}", file=sys.stderr)
        return 1
    cluster = LocalCluster(config)
    index = f"Redis index at {config.redis_url}" if config.redis_url else "in-memory index"
    print(
        f"globalkv up: {config.prefill} prefill + {config.decode} decode engines, {index}, "
        f"model {config.model}; starting…",
        file=out,
        flush=True,
    )
    if config.insecure and config.token is None:
        print("globalkv up: --insecure: any host may change any component", file=out)
    started = time.monotonic()
    status = 0
    try:
        with _signals(_interrupt):
            try:
                cluster.start()
            except (ClusterError, ValueError) as exc:
                print(f"globalkv up: could not start: {exc}", file=sys.stderr)
                return 1
            elapsed = time.monotonic() - started
            print(f"ready in {elapsed:.1f}s; run directory {cluster.run_dir}\n", file=out)
            print(table(cluster.components, cluster.plan), file=out)
            pickers = cluster.plan.by_role("epp")
            lines = curl_lines(
                cluster,
                config.model,
                admin_token=config.token is not None,
                diagnosed=pickers[0].url if pickers else None,
            )
            print("\n" + lines + "\n", file=out)
            print("Ctrl-C stops everything.", file=out, flush=True)
            status = supervise(cluster, out)
    except _Interrupted as interrupted:
        print(f"\nglobalkv up: {interrupted}: stopping…", file=out, flush=True)
    finally:
        with _signals(_ignore):
            cluster.stop()
    if status == 0:
        print("globalkv up: stopped", file=out, flush=True)
    return status
