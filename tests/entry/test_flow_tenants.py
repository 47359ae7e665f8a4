"""Flow control's tenants and refusals through the gateway's handler and the endpoint
picker (gateway/flow/keys.py, gateway/flow/control.py): a request naming no tenant is its
LoRA adapter's (`lora:<adapter>`), else its API key's (`key:<digest>`), and each is
served fairly against the others; the 429s for too many tenants and too many queued
bytes say which limit in their body, as every refusal does."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.http.answer import Answer
from gateway.settings.edge import AdmissionConfig
from gateway.settings.flow import FlowConfig
from tests.entry.flow_entry import KINDS, FlowEntry, flow_entry, status
from tests.gateway.fakes import DECODES, PREFILLS, Cluster

pytestmark = pytest.mark.timeout(30)


def models(*adapters: str) -> dict[str, Any]:
    cards = [{"id": "m", "parent": None}, *({"id": a, "parent": "m"} for a in adapters)]
    return {"object": "list", "data": cards}


async def entry(kind: str, cluster: Cluster | None = None, **flow: Any) -> FlowEntry:
    """One request at a time, so the others wait and their order shows."""
    return await flow_entry(
        kind,
        cluster,
        admission=AdmissionConfig(max_concurrent_requests=1),
        flow=FlowConfig(enabled=True, **flow),
    )


async def served_in_turn(e: FlowEntry, sends: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """The first of `sends` runs while the others wait; then each is let go in turn. The
    order they went through."""
    tasks = [e.send(name, **how) for name, how in sends[:1]]
    await e.through(1)
    for count, (name, how) in enumerate(sends[1:], start=1):
        tasks.append(e.send(name, **how))
        await e.waited(count)
    for went in range(1, len(sends)):
        e.end(e.order[went - 1])
        await e.through(went + 1)
    e.end(e.order[-1])
    assert [status(await t) for t in tasks] == [200] * len(sends)
    return e.order


@pytest.mark.parametrize("kind", KINDS)
async def test_a_request_naming_an_adapter_is_its_adapters_tenant(kind: str) -> None:
    cluster = Cluster()
    for url in (*PREFILLS, *DECODES):
        cluster.models[url.split("//", 1)[1]] = models("ad-a", "ad-b")
    e = await entry(kind, cluster)
    a, b = {"lora_path": "ad-a"}, {"lora_path": "ad-b"}
    order = await served_in_turn(e, [("a0", a), ("a1", a), ("a2", a), ("b1", b)])
    assert order == ["a0", "a1", "b1", "a2"], "ad-b is a tenant of its own, served in turn"
    assert set(e.flow.usage.own(0.0, 10)) == {"lora:ad-a", "lora:ad-b"}


@pytest.mark.parametrize("kind", KINDS)
async def test_a_request_naming_no_tenant_is_its_api_keys(kind: str) -> None:
    e = await entry(kind)
    one, two = {"authorization": "Bearer key-one"}, {"authorization": "Bearer key-two"}
    order = await served_in_turn(e, [("k0", one), ("k1", one), ("k2", one), ("j1", two)])
    assert order == ["k0", "k1", "j1", "k2"], "each API key is a tenant of its own"
    tenants = set(e.flow.usage.own(0.0, 10))
    assert len(tenants) == 2
    assert all(t.startswith("key:") and "key-" not in t for t in tenants), tenants


@pytest.mark.parametrize("kind", KINDS)
async def test_too_many_tenants_waiting_is_a_429_naming_the_flag(kind: str) -> None:
    e = await entry(kind, max_tenants=1)
    running = e.send("running", {"x-llm-d-inference-fairness-id": "a"})
    await e.through(1)
    waiting = e.send("waiting", {"x-llm-d-inference-fairness-id": "b"})  # "a" is forgotten
    await e.waited(1)
    refused = await e.send("refused", {"x-llm-d-inference-fairness-id": "c"})
    assert isinstance(refused, Answer)
    assert refused.status == 429
    assert ("retry-after", "1") in refused.headers
    error = json.loads(refused.body)["error"]
    assert (error["type"], error["code"]) == ("rate_limit_exceeded", "tenants")
    assert "--flow-max-tenants" in error["message"]
    e.end("running")
    await e.through(2)
    e.end("waiting")
    assert [status(await t) for t in (running, waiting)] == [200, 200]


@pytest.mark.parametrize("kind", KINDS)
async def test_too_many_queued_bytes_is_a_429_naming_the_flag(kind: str) -> None:
    e = await entry(kind, max_queued_bytes=600)
    running = e.send("running")
    await e.through(1)
    waiting = e.send("waiting", size=400)
    await e.waited(1)
    for name, size in (("over", 400), ("alone", 800)):  # with the one waiting; by itself
        refused = await e.send(name, size=size)
        assert isinstance(refused, Answer)
        assert refused.status == 429, name
        error = json.loads(refused.body)["error"]
        assert (error["type"], error["code"]) == ("rate_limit_exceeded", "queue_bytes")
        assert "--flow-max-queued-bytes" in error["message"]
    e.end("running")
    await e.through(2)
    e.end("waiting")
    assert [status(await t) for t in (running, waiting)] == [200, 200]
