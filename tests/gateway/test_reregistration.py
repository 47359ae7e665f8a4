"""A prefill registered with an in-memory indexer is registered again after the indexer
restarts: a real indexer process, stopped and started anew on its port, and a real engine."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import httpx
import pytest

from gateway.serving.launch import running_gateway
from gateway.settings.config import GatewayConfig
from gateway.settings.workers import HealthConfig, WorkerSpec
from tests.support.net import await_for, free_port
from tests.support.procs import Proc

pytestmark = pytest.mark.integration


def _indexer(port: int) -> Proc:
    argv = ("indexer", "--host", "127.0.0.1", "--port", str(port), "--block-size", "16")
    return Proc.globalkv(*argv, name="indexer")


@pytest.fixture
def prefill() -> Iterator[str]:
    port = free_port()
    argv = ["engine", "--role", "prefill", "--port", str(port), "--pod-id", "prefill-r"]
    argv += ["--bootstrap-port", "0", "--kv-events-endpoint", "tcp://*:0"]
    proc = Proc.globalkv(*argv, name="prefill")
    try:
        url = f"http://127.0.0.1:{port}"
        proc.wait_http(f"{url}/health")
        yield url
    finally:
        proc.stop()


async def _lists(client: httpx.AsyncClient, indexer_url: str, pod: str) -> bool:
    try:
        response = await client.get(f"{indexer_url}/v1/pods", timeout=2)
    except httpx.HTTPError:
        return False
    return response.status_code == 200 and pod in {p["id"] for p in response.json()["pods"]}


async def test_a_restarted_indexer_is_told_its_pods_again(
    prefill: str, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    indexer_url = f"http://127.0.0.1:{port}"
    indexer = _indexer(port)
    health = HealthConfig(
        interval_secs=0.2,
        startup_check_interval_secs=0.1,
        directory_refresh_secs=0.2,
        registration_check_secs=0.1,
    )
    config = GatewayConfig(
        prefill=[WorkerSpec(url=prefill, role="prefill")],
        indexer_url=indexer_url,
        prometheus_port=None,
        health=health,
    )
    caplog.set_level(logging.INFO, logger="gateway")
    try:
        await asyncio.to_thread(indexer.wait_http, f"{indexer_url}/health")
        async with running_gateway(config, None), httpx.AsyncClient() as client:
            await await_for(
                lambda: _lists(client, indexer_url, "prefill-r"), 20, "the first registration"
            )
            indexer.stop()
            indexer = _indexer(port)
            await asyncio.to_thread(indexer.wait_http, f"{indexer_url}/health")
            await await_for(
                lambda: _lists(client, indexer_url, "prefill-r"), 20, "the pod registered again"
            )
    finally:
        indexer.stop()
    assert "no longer lists its pod prefill-r" in caplog.text
