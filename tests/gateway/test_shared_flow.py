"""Flow control shared between gateway replicas (gateway/replicas/shared_flow.py): two
gateways on one real redis-server, each round of sharing run by hand. Fairness counts what
every replica served, no replica releases a request while another holds a higher
priority waiting, an objective active at one keeps its headroom at the other; what is
read of the others is checked."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from gateway.flow.control import FlowControl
from gateway.http.answer import Answer
from gateway.replicas import shared_flow
from gateway.replicas.shared_state import SharedState
from gateway.serving.inference import Inference
from gateway.serving.launch import shared_state
from gateway.settings.edge import AdmissionConfig
from gateway.settings.flow import FlowConfig
from globalkv import redis_client
from tests.gateway.fakes import DECODES, Cluster, config, make_gateway
from tests.support.clock import FakeClock
from tests.support.metrics import sample
from tests.support.net import until

OBJECTIVES = ["premium=10/500", "default=0"]


@dataclass
class Replica:
    inference: Inference
    flow: FlowControl
    shared: SharedState
    release: asyncio.Event
    decoded: list[str]

    def send(self, text: str, tenant: str, objective: str | None = None) -> asyncio.Task[Answer]:
        headers = [(b"x-llm-d-inference-fairness-id", tenant.encode())]
        if objective is not None:
            headers.append((b"x-llm-d-inference-objective", objective.encode()))
        payload = json.dumps({"text": text, "sampling_params": {"max_new_tokens": 1}}).encode()
        return asyncio.create_task(
            self.inference.handle("/generate", None, payload, tuple(headers))
        )


async def replica(client: redis_client.Client, clock: FakeClock) -> Replica:
    cluster = Cluster()
    release = asyncio.Event()
    decoded: list[str] = []

    async def held(_: httpx.Request, payload: Any) -> httpx.Response:
        decoded.append(payload["text"])
        await release.wait()
        return httpx.Response(200, json={"room": payload["bootstrap_room"]})

    for url in DECODES:
        cluster.on(url, held)
    cfg = config(
        admission=AdmissionConfig(max_concurrent_requests=1),
        flow=FlowConfig(enabled=True, objectives=OBJECTIVES),
        redis_url="redis://127.0.0.1:1/0",  # the client given is the one used
        block_size=16,
        share_state_interval_secs=1.0,
    )
    gateway = await make_gateway(cluster, cfg, clock=clock)
    shared = shared_state(cfg, gateway, client)  # as every command's process wires it
    assert gateway.flow is not None
    return Replica(Inference(gateway), gateway.flow, shared, release, decoded)


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[redis_client.Client]:
    connected = redis_client.connect(redis_url)
    yield connected
    await connected.aclose()


async def rounds(*replicas: Replica) -> None:
    """One round of sharing each, then each again: everyone has read everyone."""
    for _ in range(2):
        for r in replicas:
            await r.shared.step()


async def test_fairness_counts_what_the_other_replica_serves(client: redis_client.Client) -> None:
    clock = FakeClock()
    a, b = await replica(client, clock), await replica(client, clock)
    running = b.send("running", "other")
    await until(lambda: b.decoded == ["running"], "b's first request to reach its decode")
    waiting = [b.send(f"heavy-{i}", "heavy") for i in range(2)]
    await until(lambda: len(b.flow.queues) == 2, "heavy to wait at b")
    waiting += [b.send(f"light-{i}", "light") for i in range(2)]
    await until(lambda: len(b.flow.queues) == 4, "light to wait at b, after heavy")
    # both wait at b, even; meanwhile a serves "heavy" a lot
    a.release.set()
    for i in range(4):
        assert (await a.send(f"at-a-{i}" + "x" * 400, "heavy")).status == 200
    await rounds(a, b)
    assert b.flow.usage.decayed("heavy", clock()) > 300
    b.release.set()
    for task in (running, *waiting):
        assert (await task).status == 200
    assert b.decoded == ["running", "light-0", "light-1", "heavy-0", "heavy-1"], (
        "heavy came first at b, yet a served it"
    )


async def test_no_replica_releases_below_a_priority_waiting_at_another(
    client: redis_client.Client,
) -> None:
    clock = FakeClock()
    a, b = await replica(client, clock), await replica(client, clock)
    a_running = a.send("a-running", "t")
    b_running = b.send("b-running", "t")
    await until(lambda: len(a.decoded) == len(b.decoded) == 1, "each replica's first to run")
    premium = a.send("premium", "p", "premium")  # waits at a behind its running request
    standard = b.send("standard", "s")  # waits at b
    await until(lambda: len(a.flow.queues) == len(b.flow.queues) == 1, "one to wait at each")
    await rounds(a, b)
    assert b.flow.others.top == 10
    b.release.set()
    assert (await b_running).status == 200
    # its place was given back, and the queues looked at, before its answer was
    assert b.flow.running == 0
    assert len(b.flow.queues) == 1, "a holds a premium request waiting"
    assert not standard.done()
    assert b.decoded == ["b-running"]
    a.release.set()
    assert (await a_running).status == 200
    assert (await premium).status == 200
    await rounds(a, b)  # b learns that a has nothing waiting any more
    assert (await standard).status == 200
    assert b.decoded == ["b-running", "standard"]


async def test_an_objective_active_at_one_replica_keeps_its_headroom_at_the_other(
    client: redis_client.Client,
) -> None:
    clock = FakeClock()
    a, b = await replica(client, clock), await replica(client, clock)
    a.release.set()
    assert (await a.send("p" * 800, "p", "premium")).status == 200
    await rounds(a, b)
    active = b.flow.others.active or {}
    assert set(active) == {"premium"}
    last, tokens = active["premium"]
    assert last == pytest.approx(clock(), abs=0.01)
    assert tokens == pytest.approx(200)
    assert [r.ttft_s for r in b.flow._reserves(0, "default")] == [0.5]
    clock.advance(31)
    await rounds(a, b)
    assert not b.flow._reserves(0, "default"), "30 s after its last request"


async def test_losing_the_others_orders_only_this_replicas_requests(
    client: redis_client.Client,
) -> None:
    clock = FakeClock()
    a, b = await replica(client, clock), await replica(client, clock)
    a.flow.usage.charge("t", 1000, clock())
    await rounds(a, b)
    assert b.flow.usage.decayed("t", clock()) == pytest.approx(1000)
    shared_flow.forget(b.flow, clock())
    assert b.flow.usage.decayed("t", clock()) == 0
    assert b.flow.others.top is None


async def test_what_is_read_of_the_others_is_checked() -> None:
    clock = FakeClock()
    b = await replica(redis_client.connect("redis://127.0.0.1:1"), clock)
    good = {"t:acme": "120.5", "q:10": "2", "o:premium": "1.5,300.0"}
    bad: dict[Any, Any] = {
        "t:": "1",  # no tenant
        "t:bad tenant": "1",  # not visible ASCII
        "t:" + "x" * 300: "1",  # too long
        "t:neg": "-5",
        "t:nan": "nan",
        "t:huge": "1e30",
        "q:12345678901": "1",  # beyond int32
        "q:x": "1",
        "q:99": "-1",
        "q:98": "1e3",
        "o:premium-x": "1,1",  # not a configured objective
        "o:premium": "oops",
        "zz": "1",
        b"t:\xff": "1",  # not UTF-8
        "t:ok": b"\xff",
    }
    skipped = shared_flow.absorb(b.flow, [good, bad, "not a table"], clock())
    assert skipped == len(bad) + 1
    assert b.flow.usage.decayed("acme", clock()) == pytest.approx(120.5)
    assert b.flow.others.top == 10
    assert (b.flow.others.active or {})["premium"] == (pytest.approx(clock() - 1.5), 300.0)
    many = {f"t:t{i}": "1" for i in range(shared_flow.MAX_FIELDS + 5)}
    assert shared_flow.absorb(b.flow, [many], clock()) == 5


async def test_the_round_writes_this_replicas_flow_and_counts_what_it_skipped(
    client: redis_client.Client,
) -> None:
    clock = FakeClock()
    a, b = await replica(client, clock), await replica(client, clock)
    a.flow.usage.charge("acme", 42, clock())
    await a.shared.step()
    written = await client.hgetall(a.shared.flow_key(a.shared.member))
    assert {k.decode(): v.decode() for k, v in written.items()} == {"t:acme": "42.0"}
    assert await client.pttl(a.shared.flow_key(a.shared.member)) > 0
    await client.hset(a.shared.flow_key(a.shared.member), "q:oops", "1")
    await b.shared.step()
    registry = b.inference._gateway.metrics.registry
    assert (
        sample(registry, "globalkv_gateway_shared_state_malformed_total", what="flow fields") == 1
    )
