"""A release names the prefills that may take the request (gateway/flow/headroom.py), and
the router then chooses among them (gateway/routing/router.py), at the gateway and at the
picker: the prefill chosen is one whose predicted time to first token is within the
request's objective, with the headroom above it kept, whatever the router's own policy
prefers."""

from __future__ import annotations

import asyncio
import json
import math
from random import Random
from typing import Any

import pytest

from gateway.epp.picker import Pick, Picker
from gateway.flow.headroom import Headroom, Reserve, _Kept, _Slot
from gateway.flow.keys import FlowKey
from gateway.flow.queues import FlowRequest
from gateway.policies.base import Choice, RouteQuery
from gateway.requests.headers import PREFILL_HEADER
from gateway.serving.inference import Inference
from gateway.serving.service import Gateway
from gateway.settings.flow import FlowConfig
from gateway.settings.workers import WorkerSpec
from globalkv.lookup import LookupResult, PodHit
from tests.gateway.fakes import PREFILLS, Cluster, StubLookup, config, make_gateway
from tests.support.clock import FakeClock

A, B = (u.split("//", 1)[1] for u in PREFILLS)
C_URL = "http://10.0.0.3:30001"
C = C_URL.split("//", 1)[1]
PROMPT = 1000


def ids(count: int = PROMPT) -> bytes:
    return json.dumps({"input_ids": [5] * count, "sampling_params": {"max_new_tokens": 1}}).encode()


async def timed(clock: FakeClock, cluster: Cluster, lookup: StubLookup, **settings: Any) -> Gateway:
    """Flow control over prefills timed at 1,000 tokens/s, the prefix policy choosing."""
    flow = FlowConfig(enabled=True, objectives=["premium=10/500", "default=0"])
    gateway = await make_gateway(cluster, config(flow=flow, **settings), lookup=lookup, clock=clock)
    for worker in [w.url.split("//", 1)[1] for w in gateway.config.prefill]:
        ticket = gateway.loads.start_prefill(Choice(worker, uncached_tokens=1000))
        clock.advance(1.0)
        gateway.loads.finish(ticket)
    return gateway


def cached_on(pod: str, tokens: int) -> StubLookup:
    """The index shows `tokens` of the prompt held by `pod`."""
    return StubLookup(LookupResult(4, PROMPT // 4, [PodHit(pod, 0, tokens // 4, tokens, 1.0)]))


SLO = {"x-llm-d-slo-ttft-ms": "1050"}
"""Within reach of the idle prefill (its own 1,000 tokens: 1.0 s), not of the busy one
that holds 900 of them cached (1.0 s of work ahead, then 0.1 s)."""


async def test_the_gateway_routes_to_a_prefill_the_request_was_released_for() -> None:
    """The prefix policy weighs the queue at half a token and prefers the cached prompt on
    the busy prefill; the release says only the idle one answers within 1,050 ms."""
    clock, cluster = FakeClock(), Cluster()
    gateway = await timed(clock, cluster, cached_on(A, 900))
    busy = gateway.loads.start_prefill(Choice(A, uncached_tokens=1000))
    query = RouteQuery([5] * PROMPT)
    await gateway.router.look_up(query)
    assert gateway.router.plan(query).prefill.id == A, "the policy alone picks the busy one"
    picked = tuple((k.encode(), v.encode()) for k, v in SLO.items())
    answer = await Inference(gateway).handle("/generate", None, ids(), picked)
    assert answer.status == 200
    assert [c.worker for c in cluster.inference("prefill")] == [B]
    gateway.loads.finish(busy)


async def test_the_picker_names_a_prefill_the_request_was_released_for() -> None:
    clock = FakeClock()
    gateway = await timed(clock, Cluster(), cached_on(A, 900))
    busy = gateway.loads.start_prefill(Choice(A, uncached_tokens=1000))
    picker = Picker(gateway)
    pick = await picker.pick("/generate", ids(), None, SLO)
    assert isinstance(pick, Pick)
    assert dict(pick.headers)[PREFILL_HEADER] == B
    picker.release(pick, True)
    gateway.loads.finish(busy)


async def test_the_aggregated_picker_sends_the_request_where_it_was_released_for() -> None:
    clock = FakeClock()
    workers = [WorkerSpec(url=u, role="prefill") for u in PREFILLS]
    gateway = await timed(clock, Cluster(), cached_on(A, 900), prefill=workers, decode=[])
    busy = gateway.loads.start_prefill(Choice(A, uncached_tokens=1000))
    picker = Picker(gateway)
    pick = await picker.pick("/generate", ids(), None, SLO)
    assert isinstance(pick, Pick)
    assert pick.endpoints == [B]
    picker.release(pick, True)
    gateway.loads.finish(busy)


async def test_the_aggregated_pickers_subset_bounds_the_prefills_released_for() -> None:
    """Envoy may offer the picker only some endpoints: the request is released when one
    of those answers it in time, not when another one is free."""
    clock = FakeClock()
    workers = [WorkerSpec(url=u, role="prefill") for u in PREFILLS]
    gateway = await timed(clock, Cluster(), StubLookup(), prefill=workers, decode=[])
    busy = gateway.loads.start_prefill(Choice(A, uncached_tokens=2000))
    picker = Picker(gateway)
    waits = asyncio.Event()

    async def waiting() -> None:
        waits.set()

    picked = asyncio.create_task(picker.pick("/generate", ids(100), [A], SLO, waiting))
    async with asyncio.timeout(5):
        await waits.wait()
    flow = gateway.flow
    assert flow is not None
    assert len(flow.queues) == 1, "B is free, but the subset offers A alone, 2 s behind"
    gateway.loads.finish(busy)
    flow.look()
    pick = await picked
    assert isinstance(pick, Pick)
    assert pick.endpoints == [A]
    picker.release(pick, True)


async def test_a_release_leaves_out_a_prefill_whose_placement_takes_the_reserve() -> None:
    """Two prefills are kept for premium. A standard request placed on the idle prefill
    that holds none of its prompt (1 s of work) would leave only the other idle one; on
    the one that holds it cached (0.05 s) or on the busy one, two stay in reach."""
    clock = FakeClock()
    specs = [*config().prefill, WorkerSpec(url=C_URL, role="prefill", bootstrap_port=8997)]
    gateway = await timed(clock, Cluster(), cached_on(A, 950), prefill=specs)
    busy = gateway.loads.start_prefill(Choice(C, uncached_tokens=10_000))
    headroom = Headroom(gateway.router, gateway.config.pd_decider.transfer_tokens_per_s)
    query = RouteQuery([5] * PROMPT)
    await gateway.router.look_up(query)
    request = FlowRequest(FlowKey("s", 0, "default", None), PROMPT, PROMPT, query)
    verdict = headroom.assess(request, [Reserve(0.5, 100, prefills=2)])
    assert (verdict.late_s, verdict.prefill, verdict.within) == (0.0, A, frozenset({A, C}))
    query.within = verdict.within
    assert {c.worker for c in gateway.router.prefills(query)} == {A, C}
    gateway.loads.finish(busy)


async def test_the_router_keeps_to_the_released_prefills_while_one_of_them_remains() -> None:
    gateway = await make_gateway(Cluster(), config())
    router = gateway.router
    query = RouteQuery([1, 2, 3], within=frozenset({B}))
    assert [c.worker for c in router.prefills(query)] == [B]
    assert router.plan(query).prefill.id == B
    assert [c.worker for c in router.prefills(query, avoid={B})] == [A], "a retry goes on"
    assert [c.worker for c in router.prefills(query, among={A})] == [A], "the subset rules"
    assert {c.worker for c in router.prefills(RouteQuery([1]))} == {A, B}


def brute(reserve: Reserve, slots: list[_Slot], transfer: float, i: int, placed: float) -> float:
    """The reserve's shortfall with slot `i`'s wait made `placed`, every slot sorted."""
    kept = _Kept(reserve, slots, transfer)
    moved = [
        _Slot(s.worker, placed if j == i else s.wait, s.own, s.speed) for j, s in enumerate(slots)
    ]
    shorts = sorted(s.wait - room for s, room in zip(moved, kept._slack, strict=True))
    return shorts[min(reserve.prefills, len(shorts)) - 1]


@pytest.mark.parametrize("seed", range(40))
def test_a_reserves_shortfall_with_one_placement_is_the_sorted_ones(seed: int) -> None:
    rng = Random(seed)
    count = rng.randint(1, 7)
    slots = [
        _Slot(
            f"p{j}",
            rng.choice([0.0, 0.0, rng.uniform(0, 3), math.inf]),
            rng.uniform(0, 1),
            rng.choice([None, rng.uniform(100, 2000)]),
        )
        for j in range(count)
    ]
    reserve = Reserve(rng.uniform(0.1, 2), rng.uniform(10, 500), rng.randint(1, 4))
    kept = _Kept(reserve, slots, 3000.0)
    for i, slot in enumerate(slots):
        placed = slot.wait + rng.choice([0.0, rng.uniform(0, 2), math.inf])
        assert kept.late(i, placed) == brute(reserve, slots, 3000.0, i, placed)
