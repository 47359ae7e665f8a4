"""Gateway replicas sharing state through Redis when what they read there is malformed:
from another version, a replica with a bug, or a stranger with access to the server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from gateway.policies.base import LoadTracker
from gateway.policies.pending import PendingPrefixes
from gateway.shared_state import SharedState
from gateway.shared_wire import MAX_LOAD, Load, parse_load
from kvplumbing.tasks import cancel_and_wait
from tests.support.metrics import sample
from tests.support.net import await_for

INTERVAL = 0.05
MALFORMED = "globalkv_gateway_shared_state_malformed_total"


class Replica:
    def __init__(self, client: aioredis.Redis, name: str) -> None:
        self.loads = LoadTracker(pending=PendingPrefixes(0.0))
        self.registry = CollectorRegistry()
        self.shared = SharedState(
            client, self.loads, member=name, interval=INTERVAL, registry=self.registry, grace_s=0
        )
        self.loads.shared = self.shared
        self.task: asyncio.Task[None] | None = None

    def start(self) -> Replica:
        self.task = asyncio.create_task(self.shared.run())
        return self

    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def in_flight(self, worker: str) -> int:
        return self.loads.candidates([worker])[0].in_flight

    def malformed(self, what: str) -> float:
        return sample(self.registry, MALFORMED, what=what)


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
async def replicas(client: aioredis.Redis) -> AsyncIterator[list[Replica]]:
    made: list[Replica] = []
    yield made
    await cancel_and_wait([r.task for r in made if r.task is not None])


async def _stranger_table(client: aioredis.Redis, table: dict[bytes | str, bytes | str]) -> None:
    """A load table under a member that stays live, as any replica's would."""
    await client.hset("gkv:gw:{gw-x}:load", mapping=table)
    await client.zadd("gkv:gateways", {"gw-x": 10**15})


@pytest.mark.parametrize(
    "raw",
    ["1,2,x", "-1,0,0", "1,2", "1,2,3,4", " 1,2,3", "1_0,2,3", "+1,2,3", "١,2,3", b"\xff,1,1"],
)
def test_a_malformed_load_is_refused(raw: str | bytes) -> None:
    assert parse_load(raw) is None


def test_loads_beyond_any_real_one_are_refused() -> None:
    assert parse_load(f"{MAX_LOAD},0,7") == Load(MAX_LOAD, 0, 7)
    assert parse_load(f"{MAX_LOAD + 1},0,0") is None
    assert parse_load("9" * 400 + ",0,0") is None


async def test_a_malformed_load_costs_only_itself(
    client: aioredis.Redis, replicas: list[Replica]
) -> None:
    """It would have ended the sharing loop and frozen the other replicas' last loads."""
    a, b = Replica(client, "gw-a").start(), Replica(client, "gw-b").start()
    replicas += [a, b]
    ticket = a.loads.start("p0", 100)

    async def b_sees_a() -> bool:
        return b.in_flight("p0") == 1

    await await_for(b_sees_a, timeout=10, what="b to see a's load")
    await _stranger_table(
        client, {"p1": "1,2,not-a-number", "p2": "-5,-1000,-1000", "p3": "2,0,0", b"\xff": "1,1,1"}
    )

    async def b_skips_them() -> bool:
        return b.malformed("load entries") >= 3 and b.in_flight("p3") == 2

    await await_for(b_skips_them, timeout=10, what="b to read gw-x's table")
    a.loads.finish(ticket)

    async def b_sees_a_done() -> bool:
        return b.in_flight("p0") == 0

    await await_for(b_sees_a_done, timeout=10, what="b to see a's request done")
    assert b.running()
    assert b.loads.candidates(["p2"])[0].queued_prefill_tokens == 0  # not -1000


async def test_a_member_name_that_is_not_text_is_skipped(
    client: aioredis.Redis, replicas: list[Replica]
) -> None:
    a, b = Replica(client, "gw-a").start(), Replica(client, "gw-b").start()
    replicas += [a, b]
    await client.zadd("gkv:gateways", {b"\xff\xfe": 10**15})
    a.loads.start("p0", 100)

    async def b_sees_a() -> bool:
        return (
            b.in_flight("p0") == 1 and sample(b.registry, "globalkv_gateway_shared_replicas") == 1
        )

    await await_for(b_sees_a, timeout=10, what="b to see a's load beside the bad member")
    assert b.running()


async def test_a_round_failing_on_a_bug_falls_back_and_the_loop_goes_on(
    client: aioredis.Redis, replicas: list[Replica], monkeypatch: pytest.MonkeyPatch
) -> None:
    b = Replica(client, "gw-b")
    replicas.append(b)
    real_step = b.shared.step
    raised: list[int] = []

    async def buggy_step() -> None:
        if len(raised) < 2:
            raised.append(1)
            raise RuntimeError("a bug in a round")
        await real_step()

    monkeypatch.setattr(b.shared, "step", buggy_step)
    b.start()

    async def shares_again() -> bool:
        return sample(b.registry, "globalkv_gateway_shared_state_available") == 1

    await await_for(shares_again, timeout=10, what="b to share again after the bug")
    assert sample(b.registry, "globalkv_gateway_shared_state_failures_total") == 2
