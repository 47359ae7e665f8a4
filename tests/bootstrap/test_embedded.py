"""BootstrapServer as an engine embeds it: real sockets in the caller's event loop."""

from __future__ import annotations

import signal
import socket

import httpx
import pytest

from bootstrap.registrar import register_rank
from bootstrap.resolver import DecodeResolver, DecodeTopology
from bootstrap.server import BootstrapConfig, BootstrapServer
from tests.bootstrap.factories import registration


async def test_serves_on_a_free_port_in_the_running_loop() -> None:
    server = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0))
    handler_before = signal.getsignal(signal.SIGINT)
    await server.start()
    try:
        assert server.port > 0
        assert server.url == f"http://127.0.0.1:{server.port}"
        assert signal.getsignal(signal.SIGINT) is handler_before  # signals stay the embedder's
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"{server.url}/health")).text == "OK"
            await register_rank(client, server.url, registration())
            assert server.directory.ready
            produced = await DecodeResolver(client).resolve(server.url, DecodeTopology(1, 0), 1)
        assert produced.ranks[0].address.rank_port == 40000
    finally:
        await server.stop()
    with pytest.raises(RuntimeError, match="not started"):
        _ = server.port
    await server.stop()


async def test_wildcard_hosts_are_reached_through_loopback() -> None:
    server = BootstrapServer(BootstrapConfig(host="0.0.0.0", port=0))
    await server.start()
    try:
        assert server.url == f"http://127.0.0.1:{server.port}"
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"{server.url}/health")).status_code == 200
    finally:
        await server.stop()


async def test_a_taken_port_is_an_ordinary_oserror() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=port))
        with pytest.raises(OSError, match="in use"):
            await server.start()
        await server.stop()


async def test_starting_twice_is_refused() -> None:
    server = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0))
    await server.start()
    try:
        with pytest.raises(RuntimeError, match="already started"):
            await server.start()
    finally:
        await server.stop()
