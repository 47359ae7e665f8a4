"""Who may change the index's pods and read its lookups: protected mode, and the endpoint
schemes a pod may use.

Clients are told apart by their peer address, which the ASGI transport sets here; the
real thing, a client in another network namespace, is `tests/integration/test_protected_netns.py`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import httpx
import pytest
import zmq.asyncio
from prometheus_client import CollectorRegistry

from globalkv.api import ApiConfig, create_app
from globalkv.index.memory import MemoryIndex
from globalkv.ingest.config import IngestConfig
from globalkv.ingest.service import IngestService
from globalkv.metrics import IngestMetrics
from globalkv.registry import MemoryRegistry, PodInfo

LOCAL = ("127.0.0.1", 40000)
REMOTE = ("10.213.0.2", 40000)
POD = {"id": "p0", "model": "m", "kv_events": {"endpoint": "tcp://127.0.0.1:5557"}}
Clients = Callable[..., AbstractAsyncContextManager[tuple[httpx.AsyncClient, MemoryRegistry]]]


@pytest.fixture
def indexer(context: zmq.asyncio.Context) -> Clients:
    """An indexer's API with `config`, and a client whose peer address is `peer`."""

    @asynccontextmanager
    async def make(
        peer: tuple[str, int],
        config: ApiConfig | None = None,
        ingest_config: IngestConfig | None = None,
    ) -> AsyncIterator[tuple[httpx.AsyncClient, MemoryRegistry]]:
        index, registry = MemoryIndex(4), MemoryRegistry()
        ingest = IngestService(
            index, registry, IngestMetrics(CollectorRegistry()), ingest_config, context=context
        )
        app = create_app(
            config or ApiConfig(),
            index=index,
            registry=registry,
            ingest=ingest,
            metrics_registry=CollectorRegistry(),
        )
        transport = httpx.ASGITransport(app=app, client=peer)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://i") as client:
                yield client, registry
        finally:
            await ingest.stop()

    return make


async def test_without_a_token_loopback_clients_change_pods(indexer: Clients) -> None:
    async with indexer(LOCAL) as (client, registry):
        assert (await client.post("/v1/pods", json=POD)).status_code == 201
        assert await registry.get("p0") is not None
        assert (await client.delete("/v1/pods/p0")).status_code == 200


async def test_without_a_token_other_hosts_are_refused_and_told_how_to_fix_it(
    indexer: Clients,
) -> None:
    async with indexer(REMOTE) as (client, registry):
        added = await client.post("/v1/pods", json=POD)
        assert added.status_code == 403
        detail = added.json()["detail"]
        assert "POST /v1/pods" in detail
        assert "10.213.0.2" in detail
        assert "GLOBALKV_INDEXER_ADMIN_TOKEN" in detail
        assert "GLOBALKV_INDEXER_INSECURE" in detail
        assert await registry.get("p0") is None
        await registry.put(PodInfo.model_validate(POD))
        removed = await client.delete("/v1/pods/p0")
        assert removed.status_code == 403
        assert await registry.get("p0") is not None


async def test_reads_other_than_lookups_answer_any_host(indexer: Clients) -> None:
    async with indexer(REMOTE) as (client, _):
        assert (await client.get("/v1/pods")).status_code == 200
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/metrics")).status_code == 200


async def test_insecure_lets_any_host_change_pods(indexer: Clients) -> None:
    async with indexer(REMOTE, ApiConfig(insecure=True)) as (client, _):
        assert (await client.post("/v1/pods", json=POD)).status_code == 201
        assert (await client.delete("/v1/pods/p0")).status_code == 200


@pytest.mark.parametrize("peer", [LOCAL, REMOTE])
async def test_with_a_token_every_host_needs_it(indexer: Clients, peer: tuple[str, int]) -> None:
    async with indexer(peer, ApiConfig(admin_token="t0ken")) as (client, _):
        refused = await client.post("/v1/pods", json=POD)
        assert refused.status_code == 401
        assert "GLOBALKV_INDEXER_ADMIN_TOKEN" in refused.json()["detail"]
        auth = {"authorization": "Bearer t0ken"}
        assert (await client.post("/v1/pods", json=POD, headers=auth)).status_code == 201
        assert (await client.delete("/v1/pods/p0", headers=auth)).status_code == 200


@pytest.mark.parametrize(
    "events",
    [
        {"endpoint": "ipc:///run/engine.sock"},
        {"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "ipc:///tmp/replay"},
        {"endpoint": "inproc://indexer-internal"},
    ],
)
async def test_a_pod_on_a_non_tcp_endpoint_is_400_and_not_written(
    indexer: Clients, events: dict[str, Any]
) -> None:
    async with indexer(LOCAL) as (client, registry):
        answer = await client.post("/v1/pods", json={**POD, "kv_events": events})
        assert answer.status_code == 400
        assert "--allow-endpoint-scheme" in answer.json()["detail"]
        assert "GLOBALKV_INDEXER_ALLOW_ENDPOINT_SCHEME" in answer.json()["detail"]
        assert await registry.get("p0") is None
        assert (await client.get("/v1/pods")).json() == {"pods": []}


async def test_an_allowed_scheme_is_followed(indexer: Clients) -> None:
    pod = {**POD, "kv_events": {"endpoint": "ipc:///tmp/globalkv-test-engine"}}
    allowed = IngestConfig(allow_endpoint_schemes=["ipc"])
    async with indexer(LOCAL, ingest_config=allowed) as (client, registry):
        assert (await client.post("/v1/pods", json=pod)).status_code == 201
        assert await registry.get("p0") is not None


LOOKUP = {"model": "m", "token_ids": [1, 2, 3, 4]}


async def test_lookups_are_tenants_data_and_answer_only_loopback_without_a_token(
    indexer: Clients,
) -> None:
    async with indexer(LOCAL) as (client, _):
        assert (await client.post("/v1/lookup", json=LOOKUP)).status_code == 200
    async with indexer(REMOTE) as (client, _):
        refused = await client.post("/v1/lookup", json=LOOKUP)
        assert refused.status_code == 403
        detail = refused.json()["detail"]
        assert "which prompts the cache holds" in detail
        assert "GLOBALKV_INDEXER_ADMIN_TOKEN" in detail
        assert "GLOBALKV_INDEXER_OPEN_LOOKUPS" in detail
        assert (await client.get("/v1/pods")).status_code == 200


@pytest.mark.parametrize("config", [ApiConfig(open_lookups=True), ApiConfig(insecure=True)])
async def test_lookups_opened_answer_any_host(indexer: Clients, config: ApiConfig) -> None:
    async with indexer(REMOTE, config) as (client, _):
        assert (await client.post("/v1/lookup", json=LOOKUP)).status_code == 200
    if config.open_lookups:
        async with indexer(REMOTE, config) as (client, _):
            assert (await client.post("/v1/pods", json=POD)).status_code == 403


@pytest.mark.parametrize("peer", [LOCAL, REMOTE])
async def test_with_a_token_lookups_need_it_from_every_host(
    indexer: Clients, peer: tuple[str, int]
) -> None:
    async with indexer(peer, ApiConfig(admin_token="t0ken")) as (client, _):
        assert (await client.post("/v1/lookup", json=LOOKUP)).status_code == 401
        auth = {"authorization": "Bearer t0ken"}
        assert (await client.post("/v1/lookup", json=LOOKUP, headers=auth)).status_code == 200
