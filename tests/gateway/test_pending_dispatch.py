"""The pending table through the dispatcher: what a request in flight, a failed prefill
and a cancelled request leave for the prefix policy (fake workers, fake clock)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from gateway.legs.dispatch import Answer
from gateway.load.pending import PendingHit
from gateway.requests.bodies import parse_request
from gateway.requests.query import RouteQuery
from gateway.serving.inference import Inference
from gateway.settings.routing import PrefixWeights
from globalkv.lookup import LookupResult
from tests.gateway.fakes import (
    PREFILLS,
    Cluster,
    StubLookup,
    config,
    make_gateway,
    request_of,
    sample,
)
from tests.support.clock import FakeClock


def host(url: str) -> str:
    return url.split("//", 1)[1]


async def test_a_cancelled_request_leaves_nothing_pending() -> None:
    cluster = Cluster()
    cluster.hang_every_worker()
    gateway = await make_gateway(cluster)
    lookup = LookupResult(block_size=4, blocks=2, pods=[], keys=[31, 32])
    parsed = parse_request("generate", {"input_ids": list(range(8))})
    route = RouteQuery(list(range(8)), None, lookup)
    task = asyncio.ensure_future(gateway.dispatcher.forward(request_of(parsed, route)))
    await cluster.wait_calls(2)
    assert gateway.loads.pending_keys() == 2
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await gateway.calls.drain()
    assert gateway.loads.pending_keys() == 0


async def test_a_prompt_in_flight_draws_the_next_one_sharing_it_until_the_grace_ends() -> None:
    """The index shows nothing; the first prompt's prefill is held. The same prompt sent
    meanwhile goes where the first went, although that prefill has work queued; once the
    first answered and the grace passed, only load decides again."""
    cluster = Cluster()
    release = asyncio.Event()

    async def held(_: httpx.Request, body: Any) -> httpx.Response:
        await release.wait()
        return httpx.Response(200, json={"room": body["bootstrap_room"]})

    for url in PREFILLS:
        cluster.on(url, held)
    clock = FakeClock()
    tokens = list(range(16))
    lookup = StubLookup(LookupResult(block_size=4, blocks=4, pods=[], keys=[11, 12, 13, 14]))
    cfg = config(prefix=PrefixWeights(queued_weight=0.5, pending_grace_secs=3.0))
    gateway = await make_gateway(cluster, cfg, lookup=lookup, clock=clock)
    inference = Inference(gateway)
    body = json.dumps({"input_ids": tokens}).encode()
    first = asyncio.ensure_future(inference.handle("/generate", None, body))
    await cluster.wait_calls(2)
    (call,) = cluster.inference("prefill")
    second = asyncio.ensure_future(inference.handle("/generate", None, body))
    await cluster.wait_calls(4)
    assert [c.worker for c in cluster.inference("prefill")] == [call.worker, call.worker]
    assert gateway.loads.pending_blocks([11, 12, 13, 14]) == {call.worker: PendingHit(4, 0)}
    assert sample(gateway, "globalkv_gateway_pending_prefix_keys") == 8
    release.set()
    await asyncio.gather(first, second)
    await gateway.calls.drain()
    assert gateway.loads.pending_blocks([11, 12, 13, 14])[call.worker].blocks == 4, "grace"
    clock.now += 3.0
    assert sample(gateway, "globalkv_gateway_pending_prefix_keys") == 0
    assert gateway.loads.pending_blocks([11, 12, 13, 14]) == {}


async def test_a_prefill_that_failed_holds_nothing_for_the_prefix_policy() -> None:
    cluster = Cluster()
    cluster.one_prefill_fails(PREFILLS[1], PREFILLS[0])
    keys = [21, 22, 23]
    lookup = StubLookup(LookupResult(block_size=4, blocks=3, pods=[], keys=keys))
    gateway = await make_gateway(cluster, lookup=lookup)
    body = json.dumps({"input_ids": list(range(12))}).encode()
    answer = await Inference(gateway).handle("/generate", None, body)
    await gateway.calls.drain()
    assert isinstance(answer, Answer)
    assert answer.status == 200
    prefills = [c.worker for c in cluster.inference("prefill")]
    assert prefills == [host(PREFILLS[1]), host(PREFILLS[0])], "the broken one went first"
    assert gateway.loads.pending_blocks(keys) == {host(PREFILLS[0]): PendingHit(3, 0)}
