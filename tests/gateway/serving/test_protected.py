"""Who may change the gateway's workers: protected mode on `POST`/`DELETE /workers`.

Through the ASGI app the peer address is the transport's, so another host can be
pretended; through the gateway's own server it is the socket's, on IPv4 and IPv6 loopback.
A client in another network namespace is `tests/integration/test_protected_netns.py`.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from gateway.http.server import HttpServer
from gateway.serving.app import create_app
from gateway.serving.inference import Inference
from gateway.serving.service import Gateway
from tests.gateway.fakes import Cluster, config, make_gateway

REMOTE = ("10.213.0.2", 40000)
LOCAL = ("127.0.0.1", 40000)
NEW = {"url": "http://10.0.0.3:30001", "role": "decode"}


async def _gateway(**settings: Any) -> Gateway:
    return await make_gateway(Cluster(), config(**settings))


@asynccontextmanager
async def asgi_client(gateway: Gateway, peer: tuple[str, int]) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(gateway, run_monitor=False), client=peer)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        yield client


async def test_without_a_token_another_host_cannot_change_workers(
    gateway_no_token: Gateway,
) -> None:
    async with asgi_client(gateway_no_token, REMOTE) as client:
        added = await client.post("/workers", json=NEW)
        assert added.status_code == 403
        message = added.json()["error"]["message"]
        for words in ("POST /workers", "10.213.0.2", "protected mode"):
            assert words in message
        assert "`--admin-token` (GLOBALKV_GATEWAY_ADMIN_TOKEN)" in message
        assert "`--insecure` (GLOBALKV_GATEWAY_INSECURE)" in message
        assert gateway_no_token.find("10.0.0.3:30001") is None
        removed = await client.delete("/workers/10.0.1.1:30011")
        assert removed.status_code == 403
        assert gateway_no_token.find("10.0.1.1:30011") is not None


async def test_reads_answer_any_host(gateway_no_token: Gateway) -> None:
    async with asgi_client(gateway_no_token, REMOTE) as client:
        for path in ("/workers", "/workers/10.0.1.1:30011", "/v1/config", "/health", "/readiness"):
            assert (await client.get(path)).status_code == 200, path


async def test_without_a_token_this_machine_changes_workers(gateway_no_token: Gateway) -> None:
    async with asgi_client(gateway_no_token, LOCAL) as client:
        assert (await client.post("/workers", json=NEW)).status_code == 201
        assert (await client.delete("/workers/10.0.0.3:30001")).status_code == 200


async def test_insecure_lets_any_host_change_workers() -> None:
    gateway = await _gateway(insecure=True)
    async with asgi_client(gateway, REMOTE) as client:
        assert (await client.post("/workers", json=NEW)).status_code == 201
        assert (await client.delete("/workers/10.0.0.3:30001")).status_code == 200
        shown = (await client.get("/v1/config")).json()
    assert shown["insecure"] is True


@pytest.mark.parametrize("peer", [LOCAL, REMOTE])
async def test_with_an_admin_token_every_host_needs_it(peer: tuple[str, int]) -> None:
    gateway = await _gateway(admin_token="t0ken")
    async with asgi_client(gateway, peer) as client:
        refused = await client.post("/workers", json=NEW)
        assert refused.status_code == 401
        assert "GLOBALKV_GATEWAY_ADMIN_TOKEN" in refused.json()["error"]["message"]
        auth = {"authorization": "Bearer t0ken"}
        assert (await client.post("/workers", json=NEW, headers=auth)).status_code == 201


async def test_the_api_key_guards_workers_when_there_is_no_admin_token() -> None:
    gateway = await _gateway(api_key="k3y")
    async with asgi_client(gateway, REMOTE) as client:
        refused = await client.post("/workers", json=NEW)
        assert refused.status_code == 401
        assert "`--api-key` (GLOBALKV_GATEWAY_API_KEY)" in refused.json()["error"]["message"]
        auth = {"authorization": "Bearer k3y"}
        assert (await client.post("/workers", json=NEW, headers=auth)).status_code == 201


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        pytest.param(
            "::1",
            marks=pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here"),
        ),
    ],
)
async def test_the_own_server_passes_the_socket_peer(gateway_no_token: Gateway, host: str) -> None:
    """A loopback peer read from the socket (IPv6 names carry four fields) may change
    workers; the own server hands admin routes the peer as ASGI's (host, port)."""
    server = HttpServer(
        Inference(gateway_no_token), create_app(gateway_no_token, run_monitor=False)
    )
    await server.start(host, 0)
    shown = f"[{host}]" if ":" in host else host
    try:
        async with httpx.AsyncClient(base_url=f"http://{shown}:{server.port}") as client:
            assert (await client.post("/workers", json=NEW)).status_code == 201
    finally:
        await server.shutdown()


@pytest.fixture
async def gateway_no_token() -> Gateway:
    return await _gateway()
