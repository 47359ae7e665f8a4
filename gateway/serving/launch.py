"""What every command built on the gateway's parts does to run (`globalkv gateway`, `epp`,
`sidecar`): the process started (log level and files, the tokenizer, uvloop) and its
command registered, the gateway built from its configuration with what it opens (the
pooled client, the index, state shared with replicas, discovery, the metrics port), served
until a signal, and stopped."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import AsyncExitStack, asynccontextmanager
from logging.handlers import TimedRotatingFileHandler
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI
from prometheus_client import start_http_server

from bootstrap.reader import DirectoryReader
from gateway.http.connections import ConnectionPool
from gateway.http.server import HttpServer
from gateway.http.transport import upstream_client
from gateway.http.upstream import PooledUpstream
from gateway.legs.dispatch import Chooser
from gateway.replicas.shared_state import SharedState, member_name
from gateway.routing.router import Router
from gateway.serving.app import create_app
from gateway.serving.inference import Inference
from gateway.serving.service import Gateway, build_gateway
from gateway.settings.config import GatewayConfig
from gateway.telemetry.tracing import otlp_tracing
from gateway.workers.discovery import Follower, discovery_source
from gateway.workers.monitor import PodRegistrar
from gateway.workers.pods import HttpPodRegistrar, RegistryPodRegistrar
from globalkv import redis_client
from globalkv.extras import MissingExtra
from globalkv.index.redis import RedisIndex
from globalkv.lookup import HttpLookup, IndexLookup, PrefixLookup
from globalkv.registry import RedisRegistry
from globalkv.tokenize import Tokenizer, load_tokenizer
from kvplumbing.tasks import cancel_and_wait

log = logging.getLogger(__name__)


class CannotListen(Exception):
    """A socket the gateway must listen on could not be opened; the message names it, its
    flag and why."""


async def _index_parts(
    config: GatewayConfig, client: httpx.AsyncClient, stack: AsyncExitStack
) -> tuple[PrefixLookup | None, PodRegistrar | None]:
    if config.indexer_url:
        lookup = HttpLookup(
            client,
            config.indexer_url,
            timeout=config.lookup_timeout_secs,
            token=config.indexer_token,
        )
        registrar = HttpPodRegistrar(client, config.indexer_url, token=config.indexer_token)
        return lookup, registrar
    if config.redis_url:
        redis = redis_client.connect(config.redis_url)
        stack.push_async_callback(redis.aclose)
        registry = RedisRegistry(redis, prefix=config.redis_prefix)
        assert config.block_size is not None  # GatewayConfig requires it with redis_url
        index = RedisIndex(redis, config.block_size, prefix=config.redis_prefix)
        return IndexLookup(index), RegistryPodRegistrar(registry)
    return None, None


def shared_state(
    config: GatewayConfig, gateway: Gateway, redis: redis_client.Client
) -> SharedState:
    """What `gateway` shares with the other replicas through `redis`, wired in: its loads
    and pending prompts, and its flow control's state. The same for every command (the
    gateway, a picker, a sidecar), so replicas of any of them share with each other; its
    rounds are `SharedState.run`'s."""
    assert config.share_state_interval_secs is not None
    grace = config.prefix.pending_grace_secs
    shared = SharedState(
        redis,
        gateway.loads,
        member=member_name(config.port),
        interval=config.share_state_interval_secs,
        registry=gateway.metrics.registry,
        prefix=config.redis_prefix,
        grace_s=2.0 if grace is None else grace,
    )
    gateway.loads.shared = shared
    shared.flow = gateway.flow
    return shared


async def _share_state(config: GatewayConfig, gateway: Gateway, stack: AsyncExitStack) -> None:
    """Share with the other replicas until the gateway closes (its own client: a blocked
    pub/sub read must not hold one of the index's)."""
    assert config.redis_url is not None
    redis = redis_client.connect(config.redis_url)
    stack.push_async_callback(redis.aclose)
    shared = shared_state(config, gateway, redis)
    task = asyncio.create_task(shared.run(), name="shared state")

    async def stop() -> None:
        await cancel_and_wait([task])
        await shared.leave()

    stack.push_async_callback(stop)


async def _follow_discovery(config: GatewayConfig, gateway: Gateway, stack: AsyncExitStack) -> None:
    """Add and remove the workers discovery finds until the gateway closes."""
    source = discovery_source(config.discovery)
    if source is None:
        return
    await stack.enter_async_context(source)
    task = asyncio.create_task(Follower(gateway).run(source), name="discovery")
    stack.push_async_callback(cancel_and_wait, [task])


@asynccontextmanager
async def running_gateway(
    config: GatewayConfig,
    tokenizer: Tokenizer | None,
    chooser: Callable[[Router], Chooser] | None = None,
) -> AsyncIterator[tuple[Gateway, FastAPI]]:
    """The gateway and its app, built on the pooled client, with the app's lifespan running
    (monitor started); closed, with everything they opened, on leaving. `chooser`: as
    `build_gateway`'s."""
    async with AsyncExitStack() as stack:
        pool = ConnectionPool()
        client = await stack.enter_async_context(upstream_client(pool))
        lookup, registrar = await _index_parts(config, client, stack)
        endpoint = config.traces_endpoint
        tracing = None
        if endpoint is not None:
            tracing = otlp_tracing(endpoint, config.otlp_traces_endpoint is not None)
            stack.callback(tracing.shutdown)
            log.info("gateway spans exported by OTLP to %s", endpoint)
        gateway = build_gateway(
            config,
            client,
            upstream=PooledUpstream(pool),
            lookup=lookup,
            registrar=registrar,
            probe=DirectoryReader(client, timeout=2.0),
            tokenizer=tokenizer,
            chooser=chooser,
            tracing=tracing,
        )
        if config.share_state_interval_secs is not None:
            await _share_state(config, gateway, stack)
        await _follow_discovery(config, gateway, stack)
        if config.prometheus_port and config.prometheus_port != config.port:
            host, port = config.prometheus_host, config.prometheus_port
            try:
                metrics_server, _ = start_http_server(port, host, gateway.metrics.registry)
            except OSError as exc:
                message = f"gateway cannot serve its metrics on {host}:{port} (--prometheus-port)"
                raise CannotListen(f"{message}: {exc}") from exc
            stack.callback(metrics_server.server_close)
            stack.callback(metrics_server.shutdown)
        app = create_app(gateway)
        async with app.router.lifespan_context(app):
            yield gateway, app


async def serve_until_signalled(
    name: str, config: GatewayConfig, inference: Inference, app: FastAPI
) -> None:
    """Serve `inference` and `app` on `--port` until SIGINT or SIGTERM, then shut down."""
    server = HttpServer(
        inference,
        inference.edge.wrap(app),
        max_connections=config.max_client_connections,
        budget=inference.budget,
    )
    await listen(server, name, config)
    tune_garbage_collection()
    await until_signalled()
    await server.shutdown(grace=config.edge.shutdown_grace_period_secs)


async def listen(server: HttpServer, name: str, config: GatewayConfig) -> None:
    """`server` listening on `--host`/`--port`; `CannotListen` saying so when it cannot."""
    try:
        await server.start(config.host, config.port)
    except OSError as exc:
        where = f"{config.host}:{config.port} (--port)"
        raise CannotListen(f"{name} cannot serve on {where}: {exc}") from exc


def tune_garbage_collection() -> None:
    """Keep the objects of startup out of collections, and collect young objects rarely.

    Frozen: the objects of imports and setup, which every full collection walked again.
    Threshold 10,000 instead of 700: the request path leaves no cycles behind
    (`gateway.http.reply`), so a young collection frees nothing but walks every live
    object of the requests in flight. The measurements: `docs/gateway-design.md`.
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(10_000, older, oldest)


async def until_signalled() -> None:
    """Return on SIGINT or SIGTERM."""
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


def launch(
    args: argparse.Namespace,
    config: GatewayConfig,
    name: str,
    serving: Callable[[GatewayConfig, Tokenizer | None], Coroutine[Any, Any, None]],
) -> int:
    """Run `serving` on uvloop until it returns (a signal), as every command built on the
    gateway's parts starts: log level and files, what it serves, the tokenizer; 1 when it
    cannot."""
    if args.router_log_level:
        level = {"warn": "WARNING"}.get(args.router_log_level, args.router_log_level.upper())
        logging.getLogger("gateway").setLevel(level)
    log.info(
        "%s on %s:%d: %d prefill, %d decode, policies %s/%s, index %s",
        name,
        config.host,
        config.port,
        len(config.prefill),
        len(config.decode),
        config.prefill_policy,
        config.decode_policy,
        config.indexer_url or config.redis_url or "none",
    )
    if config.edge.log_dir is not None:
        try:
            log_to_dir(Path(config.edge.log_dir))
        except OSError as exc:
            log.error("%s: cannot write logs to %s: %s", name, config.edge.log_dir, exc)
            return 1
    if config.discovery.selector:
        log.warning(
            "--selector is sglang-router's regular-mode selector; in PD mode the "
            "--prefill-selector and --decode-selector choose the pods, and it is ignored"
        )
    for warning in config.protected_mode().warnings():
        log.warning("%s", warning)
    try:
        tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer else None
    except ValueError as exc:
        log.error("%s: cannot load the tokenizer: %s", name, exc)
        return 1
    import uvloop

    try:
        uvloop.run(serving(config, tokenizer))
    except CannotListen as exc:
        log.error("%s", exc)
        return 1
    except (ValueError, MissingExtra) as exc:  # discovery that cannot start
        log.error("%s cannot start: %s", name, exc)
        return 1
    return 0


LOG_FILE = "globalkv-gateway.log"
LOG_FILES_KEPT = 7


def log_to_dir(directory: Path) -> None:
    """Every log line also to `directory/LOG_FILE`, a new file each midnight and the last
    `LOG_FILES_KEPT` kept (sglang-router's `--log-dir` rolls daily too; keeping every day
    would fill a volume in the end). The directory is made if missing."""
    directory.mkdir(parents=True, exist_ok=True)
    handler = TimedRotatingFileHandler(
        directory / LOG_FILE, when="midnight", backupCount=LOG_FILES_KEPT, encoding="utf-8"
    )
    root = logging.getLogger()
    formatter = next((h.formatter for h in root.handlers if h.formatter is not None), None)
    handler.setFormatter(formatter or logging.Formatter(_LOG_FORMAT))
    root.addHandler(handler)


_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def add_command(
    subparsers: Any,
    name: str,
    summary: str,
    description: str | None,
    add_flags: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
    check_config: Callable[[argparse.Namespace], list[str]],
) -> None:
    """Register `globalkv <name>` with the dispatcher (`docs/development.md`, "Commands")."""
    parser = subparsers.add_parser(
        name,
        help=summary,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_flags(parser)
    parser.set_defaults(run=run, check_config=check_config)
