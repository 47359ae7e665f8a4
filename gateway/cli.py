"""`globalkv gateway`: sglang-router's PD flags as they are, plus the index's.

    globalkv gateway --pd-disaggregation \\
        --prefill http://10.0.0.1:30001 8998 --prefill http://10.0.0.2:30001 none \\
        --decode http://10.0.0.3:30011 --indexer-url http://10.0.0.9:8100

`--policy` sets both sides as in sglang-router; without it prefill uses `prefix` and
decode `power_of_two`. Flags are read here only; everything else takes `GatewayConfig`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx
import redis.asyncio as aioredis
from fastapi import FastAPI
from prometheus_client import start_http_server
from pydantic import ValidationError

from bootstrap.reader import DirectoryReader
from gateway.app import create_app
from gateway.config import (
    BreakerConfig,
    CacheAwareConfig,
    GatewayConfig,
    HealthConfig,
    PrefixWeights,
    RetryConfig,
    WorkerSpec,
    optional_float,
)
from gateway.connections import ConnectionPool
from gateway.inference import Inference
from gateway.monitor import PodRegistrar
from gateway.pods import HttpPodRegistrar, RegistryPodRegistrar
from gateway.server import GatewayServer
from gateway.service import Gateway, build_gateway
from gateway.transport import upstream_client
from gateway.upstream import PooledUpstream
from globalkv.index.redis import RedisIndex
from globalkv.lookup import HttpLookup, IndexLookup, PrefixLookup
from globalkv.registry import RedisRegistry
from globalkv.tokenize import Tokenizer, load_tokenizer
from kvplumbing.validation import validation_message

log = logging.getLogger(__name__)
POLICIES = ["prefix", "cache_aware", "power_of_two", "round_robin", "random", "least_load"]
_SHUTDOWN_GRACE_SECS = 5.0
"""Answers in flight get this long after SIGTERM, inside the 10 s that `globalkv up` and
most supervisors allow before SIGKILL, leaving time for the rest of the shutdown."""


def _add_flags(p: argparse.ArgumentParser) -> None:
    add = p.add_argument
    add("--pd-disaggregation", action="store_true", help="PD mode (the only mode; accepted)")
    add(
        "--prefill",
        nargs="+",
        action="append",
        default=[],
        metavar="URL [BOOTSTRAP_PORT|none]",
        help="a prefill worker and its bootstrap port (none or omitted: null); repeatable",
    )
    add(
        "--decode",
        nargs=1,
        action="append",
        default=[],
        metavar="URL",
        help="a decode worker; repeatable",
    )
    add("--worker-urls", nargs="*", default=[], help="sglang-router's regular mode: refused")
    add("--host", default="0.0.0.0")
    add("--port", type=int, default=30000)
    add("--policy", choices=POLICIES, help="policy of both sides unless overridden")
    add("--prefill-policy", choices=POLICIES, help="default: prefix")
    add("--decode-policy", choices=POLICIES, help="default: power_of_two")
    add("--cache-threshold", type=float, default=0.3)
    add("--balance-abs-threshold", type=int, default=64)
    add("--balance-rel-threshold", type=float, default=1.5)
    add("--eviction-interval-secs", type=float, default=60)
    add("--max-tree-size", type=int, default=2**26)
    add(
        "--prefix-uncached-weight",
        type=float,
        default=1.0,
        help="prefix policy: cost per uncached prompt token",
    )
    add(
        "--prefix-queued-weight",
        type=float,
        default=0.5,
        help="prefix policy: cost per prefill token already queued on the pod",
    )
    add(
        "--prefix-request-cost",
        type=float,
        default=0.0,
        help="prefix policy: cost in tokens per request in flight on the pod",
    )
    add(
        "--prefix-pending-grace-secs",
        type=optional_float,
        default=2.0,
        help="prefix policy: a prompt sent to a prefill counts as held there until this long "
        "after the prefill answered (the index shows it by then; a prefill that failed holds "
        "nothing); off: only the index",
    )
    add("--api-key", help="require Authorization: Bearer <key> on inference endpoints")
    add("--admin-token", help="require Authorization: Bearer <token> on /workers mutations")
    add("--request-timeout-secs", type=float, default=1800)
    add("--max-payload-size", type=int, default=512 * 1024 * 1024)
    add("--prometheus-port", type=int, default=29000, help="0 = only /metrics on --port")
    add("--prometheus-host", default="0.0.0.0")
    add("--retry-max-retries", type=int, default=5)
    add("--retry-initial-backoff-ms", type=int, default=50)
    add("--retry-max-backoff-ms", type=int, default=30_000)
    add("--retry-backoff-multiplier", type=float, default=1.5)
    add("--retry-jitter-factor", type=float, default=0.2)
    add("--disable-retries", action="store_true")
    add("--cb-failure-threshold", type=int, default=10)
    add("--cb-success-threshold", type=int, default=3)
    add("--cb-timeout-duration-secs", type=float, default=60)
    add("--cb-window-duration-secs", type=float, default=120)
    add("--disable-circuit-breaker", action="store_true")
    add("--health-failure-threshold", type=int, default=3)
    add("--health-success-threshold", type=int, default=2)
    add("--health-check-timeout-secs", type=float, default=5)
    add("--health-check-interval-secs", type=float, default=60)
    add("--health-check-endpoint", default="/health")
    add("--disable-health-check", action="store_true")
    add(
        "--worker-startup-check-interval",
        type=float,
        default=1.0,
        help="seconds between checks of a worker not yet seen healthy",
    )
    add(
        "--directory-refresh-secs",
        type=float,
        default=5.0,
        help="seconds between reads of each prefill's bootstrap directory",
    )
    add("--redis-url", help="read the index and the pod registry from this Redis")
    add("--redis-prefix", default="gkv", help="key prefix of the index and registry in Redis")
    add("--indexer-url", help="ask this indexer's HTTP API (lookups, pod registration)")
    add("--indexer-token", help="admin token of the indexer, for pod registration")
    add("--model", help="model name keyed in the index (default: the prefills' served name)")
    add(
        "--tokenizer",
        "--tokenizer-path",
        dest="tokenizer",
        help="tokenizer.json, a model directory, or 'byte'",
    )
    add("--model-path", help="sglang-router: a local model directory used as the tokenizer")
    add("--block-size", type=int, help="index block size (required with --redis-url)")
    add("--lookup-timeout-secs", type=float, default=0.5)
    add("--seed", type=int, help="seed of the routing RNG, for reproducible choices")
    add(
        "--router-log-level",
        "--log-level",
        dest="router_log_level",
        choices=["debug", "info", "warn", "warning", "error"],
        help="sglang-router's log level flag, applied to the gateway's loggers",
    )


def _prefill_spec(values: list[str]) -> WorkerSpec:
    if len(values) > 2:
        raise ValueError(f"--prefill takes URL [BOOTSTRAP_PORT|none], got {' '.join(values)}")
    port: int | None = None
    if len(values) == 2 and values[1].lower() != "none":
        if not values[1].isdigit():
            raise ValueError(f"--prefill bootstrap port must be a number or none: {values[1]!r}")
        port = int(values[1])
    return WorkerSpec(url=values[0], role="prefill", bootstrap_port=port)


def build_config(args: argparse.Namespace) -> GatewayConfig:
    """The typed configuration; `ValueError` with the reason when the flags are wrong."""
    if args.worker_urls:
        raise ValueError("--worker-urls (regular mode) is not supported: use --prefill/--decode")
    try:
        return GatewayConfig(
            host=args.host,
            port=args.port,
            prometheus_host=args.prometheus_host,
            prometheus_port=args.prometheus_port or None,
            prefill=[_prefill_spec(v) for v in args.prefill],
            decode=[WorkerSpec(url=v[0], role="decode") for v in args.decode],
            prefill_policy=args.prefill_policy or args.policy or "prefix",
            decode_policy=args.decode_policy or args.policy or "power_of_two",
            prefix=PrefixWeights(
                uncached_weight=args.prefix_uncached_weight,
                queued_weight=args.prefix_queued_weight,
                request_cost=args.prefix_request_cost,
                pending_grace_secs=args.prefix_pending_grace_secs,
            ),
            cache_aware=CacheAwareConfig(
                cache_threshold=args.cache_threshold,
                balance_abs_threshold=args.balance_abs_threshold,
                balance_rel_threshold=args.balance_rel_threshold,
                eviction_interval_secs=args.eviction_interval_secs,
                max_tree_size=args.max_tree_size,
            ),
            retry=RetryConfig(
                max_retries=args.retry_max_retries,
                initial_backoff_ms=args.retry_initial_backoff_ms,
                max_backoff_ms=args.retry_max_backoff_ms,
                backoff_multiplier=args.retry_backoff_multiplier,
                jitter_factor=args.retry_jitter_factor,
                disabled=args.disable_retries,
            ),
            breaker=BreakerConfig(
                failure_threshold=args.cb_failure_threshold,
                success_threshold=args.cb_success_threshold,
                timeout_duration_secs=args.cb_timeout_duration_secs,
                window_duration_secs=args.cb_window_duration_secs,
                disabled=args.disable_circuit_breaker,
            ),
            health=HealthConfig(
                failure_threshold=args.health_failure_threshold,
                success_threshold=args.health_success_threshold,
                timeout_secs=args.health_check_timeout_secs,
                interval_secs=args.health_check_interval_secs,
                endpoint=args.health_check_endpoint,
                disabled=args.disable_health_check,
                startup_check_interval_secs=args.worker_startup_check_interval,
                directory_refresh_secs=args.directory_refresh_secs,
            ),
            api_key=args.api_key,
            admin_token=args.admin_token,
            request_timeout_secs=args.request_timeout_secs,
            max_payload_size=args.max_payload_size,
            redis_url=args.redis_url,
            redis_prefix=args.redis_prefix,
            indexer_url=args.indexer_url,
            indexer_token=args.indexer_token,
            model=args.model,
            tokenizer=args.tokenizer or args.model_path,
            block_size=args.block_size,
            lookup_timeout_secs=args.lookup_timeout_secs,
            seed=args.seed,
        )
    except ValidationError as exc:
        raise ValueError(validation_message(exc)) from None


def check_config(args: argparse.Namespace) -> None:
    build_config(args)


async def _index_parts(
    config: GatewayConfig, client: httpx.AsyncClient, stack: AsyncExitStack
) -> tuple[PrefixLookup | None, PodRegistrar | None]:
    if config.indexer_url:
        lookup = HttpLookup(client, config.indexer_url, timeout=config.lookup_timeout_secs)
        registrar = HttpPodRegistrar(client, config.indexer_url, token=config.indexer_token)
        return lookup, registrar
    if config.redis_url:
        redis = aioredis.Redis.from_url(config.redis_url)
        stack.push_async_callback(redis.aclose)
        registry = RedisRegistry(redis, prefix=config.redis_prefix)
        assert config.block_size is not None  # GatewayConfig requires it with redis_url
        index = RedisIndex(redis, config.block_size, prefix=config.redis_prefix)
        return IndexLookup(index), RegistryPodRegistrar(registry)
    return None, None


@asynccontextmanager
async def running_gateway(
    config: GatewayConfig, tokenizer: Tokenizer | None
) -> AsyncIterator[tuple[Gateway, FastAPI]]:
    """The gateway and its app, built on the pooled client, with the app's lifespan running
    (monitor started); closed, with everything they opened, on leaving."""
    async with AsyncExitStack() as stack:
        pool = ConnectionPool()
        client = await stack.enter_async_context(upstream_client(pool))
        lookup, registrar = await _index_parts(config, client, stack)
        gateway = build_gateway(
            config,
            client,
            upstream=PooledUpstream(pool),
            lookup=lookup,
            registrar=registrar,
            probe=DirectoryReader(client, timeout=2.0),
            tokenizer=tokenizer,
        )
        if config.prometheus_port and config.prometheus_port != config.port:
            metrics_server, _ = start_http_server(
                config.prometheus_port, config.prometheus_host, gateway.metrics.registry
            )
            stack.callback(metrics_server.shutdown)
        app = create_app(gateway)
        async with app.router.lifespan_context(app):
            yield gateway, app


async def serve(config: GatewayConfig, tokenizer: Tokenizer | None) -> None:
    async with running_gateway(config, tokenizer) as (gateway, app):
        server = GatewayServer(Inference(gateway), app)
        await server.start(config.host, config.port)
        tune_garbage_collection()
        await _until_signalled()
        await server.shutdown(grace=_SHUTDOWN_GRACE_SECS)


def tune_garbage_collection() -> None:
    """Keep the objects of startup out of collections, and collect young objects rarely.

    Measured under `bench.gateway` at concurrency 64. Frozen: the ~100k objects of imports
    and setup, which full collections walked every few hundred milliseconds, 30 ms each —
    about 15 % of the CPU and most of the p99 (45 ms before, 15 ms after). Threshold
    10,000 instead of 700: the request path leaves no cycles behind (`gateway.calls`), so
    a young collection frees nothing, but with 64 requests in flight their live objects
    outgrew 700 every few milliseconds and each collection walked them all (~4 µs of CPU
    per request); at 10,000 none ran in a 3 s run.
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(10_000, older, oldest)


async def _until_signalled() -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


def run(args: argparse.Namespace) -> int:
    config = build_config(args)
    if args.router_log_level:
        level = {"warn": "WARNING"}.get(args.router_log_level, args.router_log_level.upper())
        logging.getLogger("gateway").setLevel(level)
    log.info(
        "gateway on %s:%d: %d prefill, %d decode, policies %s/%s, index %s",
        config.host,
        config.port,
        len(config.prefill),
        len(config.decode),
        config.prefill_policy,
        config.decode_policy,
        config.indexer_url or config.redis_url or "none",
    )
    try:
        tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer else None
    except ValueError as exc:
        log.error("gateway: cannot load the tokenizer: %s", exc)
        return 1
    import uvloop

    try:
        uvloop.run(serve(config, tokenizer))
    except OSError as exc:
        log.error("gateway cannot serve on %s:%d: %s", config.host, config.port, exc)
        return 1
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "gateway",
        help="the PD gateway (sglang-router compatible flags)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_flags(parser)
    parser.set_defaults(run=run, check_config=check_config)
