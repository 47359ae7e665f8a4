"""Registering prefills as pods: both registrars, and how their failures surface."""

from __future__ import annotations

import dataclasses
import json

import httpx
import pytest

from gateway.serving.app import create_app
from gateway.settings.workers import KvEventsSpec
from gateway.workers.monitor import PodRegistration, RegistrationFailed
from gateway.workers.pods import HttpPodRegistrar, RegistryPodRegistrar, pod_info
from globalkv.index.base import IndexUnavailable
from globalkv.registry import MemoryRegistry, PodInfo
from tests.gateway.fakes import POD, Cluster, config, make_gateway


async def test_the_http_registrar_posts_the_pod_with_the_token_and_deletes_it() -> None:
    seen: list[tuple[str, str, str | None, object]] = []

    def indexer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        seen.append((request.method, request.url.path, request.headers.get("authorization"), body))
        return httpx.Response(404 if request.method == "DELETE" else 201)

    async with httpx.AsyncClient(transport=httpx.MockTransport(indexer)) as client:
        registrar = HttpPodRegistrar(client, "http://ix:8100/", token="t")
        await registrar.register(POD)
        await registrar.unregister("pod-a")  # 404: already gone, not a failure
    (method, path, auth, body), deleted = seen
    assert (method, path, auth) == ("POST", "/v1/pods", "Bearer t")
    assert isinstance(body, dict)
    assert (body["id"], body["dp_size"], body["kv_events"]["topic"]) == ("pod-a", 2, "kv@pod-a@m")
    assert deleted[:3] == ("DELETE", "/v1/pods/pod-a", "Bearer t")


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (httpx.Response(500, text="boom"), "indexer answered 500: boom"),
        (
            httpx.Response(403, text="x" * 300 + " (protected mode) GLOBALKV_INDEXER_INSECURE"),
            "GLOBALKV_INDEXER_INSECURE; give the gateway .*GLOBALKV_GATEWAY_INDEXER_TOKEN",
        ),
        (httpx.Response(401, text="token"), "--indexer-token"),
        (httpx.ConnectError("refused"), "indexer unreachable"),
    ],
)
async def test_http_registrar_failures_are_registration_failures(
    answer: httpx.Response | Exception, message: str
) -> None:
    def indexer(_: httpx.Request) -> httpx.Response:
        if isinstance(answer, Exception):
            raise answer
        return answer

    async with httpx.AsyncClient(transport=httpx.MockTransport(indexer)) as client:
        registrar = HttpPodRegistrar(client, "http://ix:8100")
        for call in (registrar.register(POD), registrar.unregister("pod-a")):
            with pytest.raises(RegistrationFailed, match=message):
                await call


class _DownRegistry(MemoryRegistry):
    async def put(self, pod: PodInfo) -> None:
        raise IndexUnavailable("pod registry unreachable: ConnectionError()")

    async def remove(self, pod_id: str) -> bool:
        raise IndexUnavailable("pod registry unreachable: ConnectionError()")


async def test_the_registry_registrar_writes_the_registry_and_reports_it_down() -> None:
    registry = MemoryRegistry()
    await RegistryPodRegistrar(registry).register(POD)
    assert [p.id for p in await registry.list()] == ["pod-a"]
    down = RegistryPodRegistrar(_DownRegistry())
    for call in (down.register(POD), down.unregister("pod-a")):
        with pytest.raises(RegistrationFailed, match="pod registry unreachable"):
            await call


def test_a_pod_the_registry_cannot_hold_is_a_registration_failure() -> None:
    bound = KvEventsSpec(endpoint="tcp://*:5557")
    with pytest.raises(RegistrationFailed, match="pod pod-a: kv_events"):
        pod_info(dataclasses.replace(POD, kv_events=bound))


class _Refusing:
    async def register(self, pod: PodRegistration) -> None:
        return None

    async def unregister(self, pod_id: str) -> None:
        raise RegistrationFailed("indexer answered 503: busy")

    async def listed(self) -> set[str]:
        return set()


async def test_removing_a_worker_whose_pod_cannot_be_unregistered_still_removes_it() -> None:
    gateway = await make_gateway(Cluster(), config(), registrar=_Refusing())
    (prefill, *_) = gateway.pool.role("prefill")
    prefill.registered_pod = "pod-a"
    transport = httpx.ASGITransport(app=create_app(gateway, run_monitor=False))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        response = await client.delete(f"/workers/{prefill.id}")
    assert response.status_code == 200
    assert response.json() == {
        "removed": prefill.id,
        "unregister_error": "RegistrationFailed('indexer answered 503: busy')",
    }
    assert gateway.pool.get(prefill.id) is None
