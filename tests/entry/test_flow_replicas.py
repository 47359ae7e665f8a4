"""Flow control shared between endpoint pickers, and between pickers and gateways, through a
real redis-server this test session started (gateway/replicas/shared_flow.py): strict
order across bands, fairness counting what every replica served, and an objective's
reserve kept at every replica.

Each replica runs in this process on its own gateway's parts (its pool, loads, flow
control, picker or handler: `tests.entry.flow_entry`), wired to Redis by
`gateway.serving.launch.shared_state`, the function every command's process runs
(`globalkv epp`, `gateway`, `sidecar`); the rounds of sharing, which the processes run
every interval, are run here by hand, so each test says when a replica has heard the others."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from gateway.policies.base import Choice
from gateway.serving.launch import shared_state
from gateway.settings.edge import AdmissionConfig
from gateway.settings.flow import FlowConfig
from globalkv import redis_client
from tests.entry.flow_entry import FlowEntry, flow_entry, status
from tests.gateway.fakes import PREFILLS
from tests.support.clock import FakeClock

pytestmark = pytest.mark.timeout(30)

OBJECTIVES = ["premium=10/500", "default=0"]
P0, P1 = (u.split("//", 1)[1] for u in PREFILLS)
PAIRS = [("picker", "picker"), ("gateway", "picker"), ("picker", "gateway")]
IDS = [f"{a}-{b}" for a, b in PAIRS]


@dataclass
class Redis:
    url: str
    client: redis_client.Client


async def replica(kind: str, redis: Redis, clock: FakeClock, **admission: Any) -> FlowEntry:
    """An entry sharing its state through `redis`, wired as every command's process wires
    it (`shared_state`)."""
    made = await flow_entry(
        kind,
        clock=clock,
        admission=AdmissionConfig(**{"max_concurrent_requests": 1, **admission}),
        flow=FlowConfig(enabled=True, objectives=OBJECTIVES),
        redis_url=redis.url,
        block_size=16,
        share_state_interval_secs=1.0,
    )
    made.shared = shared_state(made.gateway.config, made.gateway, redis.client)
    return made


def flow(tenant: str, objective: str | None = None) -> dict[str, str]:
    headers = {"x-llm-d-inference-fairness-id": tenant}
    if objective is not None:
        headers["x-llm-d-inference-objective"] = objective
    return headers


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    """The session's redis-server, emptied, and a client of it."""
    connected = redis_client.connect(redis_url)
    yield Redis(redis_url, connected)
    await connected.aclose()


async def rounds(*replicas: FlowEntry) -> None:
    """One round of sharing each, then each again: everyone has read everyone."""
    for _ in range(2):
        for r in replicas:
            assert r.shared is not None
            await r.shared.step()


@pytest.mark.parametrize(("first", "second"), PAIRS, ids=IDS)
async def test_no_replica_releases_below_a_band_waiting_at_another(
    redis: Redis, first: str, second: str
) -> None:
    clock = FakeClock()
    a, b = await replica(first, redis, clock), await replica(second, redis, clock)
    running = [a.send("a-running", flow("t")), b.send("b-running", flow("t"))]
    await a.through(1)
    await b.through(1)
    premium = a.send("premium", flow("p", "premium"))
    standard = b.send("standard", flow("s"))
    await a.waited(1)
    await b.waited(1)
    await rounds(a, b)
    assert b.flow.others.top == 10
    b.end("b-running")
    await running[1]
    assert len(b.flow.queues) == 1, "a holds a premium request waiting: b's place stays free"
    assert b.flow.running == 0
    a.end("a-running")
    await running[0]
    await a.through(2)
    assert a.order == ["a-running", "premium"]
    await rounds(a, b)  # b hears that nothing of a higher band waits any more
    await b.through(2)
    assert b.order == ["b-running", "standard"]
    a.end("premium")
    b.end("standard")
    assert [status(await t) for t in (*running, premium, standard)] == [200] * 4


@pytest.mark.parametrize(("first", "second"), PAIRS, ids=IDS)
async def test_fairness_counts_what_the_other_replica_serves(
    redis: Redis, first: str, second: str
) -> None:
    clock = FakeClock()
    a, b = await replica(first, redis, clock), await replica(second, redis, clock)
    running = b.send("running", flow("other"))
    await b.through(1)
    waiting = [b.send(f"heavy{i}", flow("heavy")) for i in range(2)]
    waiting += [b.send(f"light{i}", flow("light")) for i in range(2)]
    await b.waited(4)
    for i in range(4):  # meanwhile a serves "heavy" 4 x 400 tokens
        a.send(f"at-a{i}", flow("heavy"), size=1600)
        await a.through(i + 1)
        a.end(f"at-a{i}")
    await rounds(a, b)
    assert b.flow.usage.decayed("heavy", clock()) >= 1600
    for served, name in enumerate(["running", "light0", "light1", "heavy0"], start=1):
        await b.through(served)
        b.end(name)
    await b.through(5)
    b.end("heavy1")
    assert b.order == ["running", "light0", "light1", "heavy0", "heavy1"], (
        "heavy came first at b, yet a served it"
    )
    assert [status(await t) for t in (running, *waiting)] == [200] * 5


async def timed(r: FlowEntry, clock: FakeClock) -> None:
    """Both prefills measured at 1,000 tokens/s by this replica."""
    loads = r.gateway.loads
    for worker in (P0, P1):
        ticket = loads.start_prefill(Choice(worker, uncached_tokens=1000))
        clock.advance(1.0)
        loads.finish(ticket)


@pytest.mark.parametrize(("first", "second"), PAIRS, ids=IDS)
async def test_an_objective_active_at_one_replica_keeps_its_reserve_at_the_other(
    redis: Redis, first: str, second: str
) -> None:
    """Premium requests come to a; a's busy prefill is b's too (the loads are shared).
    A standard request at b would take the one prefill left that answers premium in time:
    it waits until premium has been quiet for --flow-reserve-secs."""
    clock = FakeClock()
    a = await replica(first, redis, clock, max_concurrent_requests=-1)
    b = await replica(second, redis, clock, max_concurrent_requests=-1)
    for r in (a, b):
        await timed(r, clock)
    premium = a.send("premium", flow("p", "premium"), size=400)
    await a.through(1)
    a.end("premium")
    assert status(await premium) == 200
    busy = a.gateway.loads.start_prefill(Choice(P1, uncached_tokens=40_000))
    await rounds(a, b)
    assert b.gateway.loads.shared is not None
    assert b.gateway.loads.shared.load(P1)[2] == 40_000, "a's work on P1, as b reads it"
    standard = b.send("standard", flow("s"), size=4000)
    await b.waited(1)
    assert len(b.flow.queues) == 1
    clock.advance(29)
    await rounds(a, b)
    assert len(b.flow.queues) == 1, "premium came 29 s ago: still active"
    clock.advance(2)
    await rounds(a, b)  # 31 s: a no longer says premium is active
    await b.through(1)
    assert b.order == ["standard"]
    b.end("standard")
    assert status(await standard) == 200
    a.gateway.loads.finish(busy)
