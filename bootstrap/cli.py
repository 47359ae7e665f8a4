"""`globalkv bootstrap`: a standalone directory, for multi-node instances and for tests.

Every flag also reads `GLOBALKV_BOOTSTRAP_<FLAG>` (the dispatcher maps them). The
process serves until SIGTERM or SIGINT, then closes its connections and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from typing import Any

import uvloop

from bootstrap.protocol import COMPAT_VERSIONS, DEFAULT_COMPAT
from bootstrap.server import BootstrapConfig, BootstrapServer
from kvplumbing.validation import validation_as_value_error

log = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    defaults = BootstrapConfig()
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "bootstrap",
        help="run an SGLang-compatible bootstrap directory",
        description="Serve one Prefill instance's bootstrap directory (SGLang's /route, "
        "/register_dp_rank, /query_dp_ranks, /health) plus /v1/directory and /metrics.",
    )
    parser.add_argument("--host", default=defaults.host, help="listen address")
    parser.add_argument("--port", type=int, default=defaults.port, help="listen port")
    parser.add_argument(
        "--sglang-compat",
        default=DEFAULT_COMPAT,
        choices=COMPAT_VERSIONS,
        help="SGLang version of the decodes; fixes the topology snapshot's keys",
    )
    parser.add_argument(
        "--room-ttl",
        type=float,
        default=defaults.room_ttl,
        metavar="SECONDS",
        help="how long a room -> dp_rank entry is kept",
    )
    parser.add_argument(
        "--max-rooms",
        type=int,
        default=defaults.max_rooms,
        metavar="N",
        help="cap on room entries, the oldest evicted first",
    )
    parser.add_argument(
        "--admin-token",
        metavar="TOKEN",
        help="required as 'Authorization: Bearer TOKEN' by DELETE /v1/directory; without "
        "one, only loopback clients may reset (SGLang's paths never ask)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="without --admin-token, let any host reset the directory",
    )
    parser.set_defaults(run=run, check_config=check_config)


def config_from_args(args: argparse.Namespace) -> BootstrapConfig:
    with validation_as_value_error():
        return BootstrapConfig(
            host=args.host,
            port=args.port,
            sglang_compat=args.sglang_compat,
            room_ttl=args.room_ttl,
            max_rooms=args.max_rooms,
            admin_token=args.admin_token,
            insecure=args.insecure,
        )


def check_config(args: argparse.Namespace) -> None:
    config_from_args(args)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        log.error("invalid configuration: %s", exc)
        return 2
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(serve(config))


async def serve(config: BootstrapConfig) -> int:
    """Serve until a termination signal; 1 if the address cannot be bound."""
    server = BootstrapServer(config)
    try:
        await server.start()
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", config.host, config.port, exc)
        return 1
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    try:
        await stopping.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await server.stop()
    log.info("bootstrap directory stopped")
    return 0
