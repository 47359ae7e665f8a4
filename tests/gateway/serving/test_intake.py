"""One way in for the gateway's handler and the endpoint picker (gateway/serving/intake.py):
read, looked up, admitted, looked up again when it waited. Each behaviour is checked at
both entry points, driven as their servers drive them."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from gateway.epp.picker import Pick, Picker
from gateway.flow.admission import Admission
from gateway.http.answer import Answer
from gateway.serving.inference import Inference
from gateway.serving.intake import Waiting
from gateway.serving.service import Gateway
from gateway.settings.edge import AdmissionConfig
from gateway.settings.flow import FlowConfig
from tests.gateway.fakes import DECODES, Cluster, StubLookup, config, make_gateway

pytestmark = pytest.mark.timeout(30)

ENTRIES = ["gateway", "picker"]


class Entry:
    """A gateway's handler or a picker over one gateway: `send` a request; a request let
    in holds its place until `end`."""

    def __init__(self, kind: str, gateway: Gateway, cluster: Cluster) -> None:
        self.kind = kind
        self.gateway = gateway
        self.cluster = cluster
        self._answers = asyncio.Event()
        if kind == "picker":
            self._picker = Picker(gateway)
            self.intake = self._picker._intake
        else:
            self._inference = Inference(gateway)
            self.intake = self._inference.intake

        async def held(_: httpx.Request, body: Any) -> httpx.Response:
            await self._answers.wait()
            return httpx.Response(200, json={"room": body["bootstrap_room"]})

        for url in DECODES:
            cluster.on(url, held)

    def send(self, body: bytes, headers: dict[str, str] | None = None) -> asyncio.Task[Any]:
        given = headers or {}
        if self.kind == "picker":
            return asyncio.create_task(self._picker.pick("/generate", body, None, given))
        picked = tuple((k.encode(), v.encode()) for k, v in given.items())
        return asyncio.create_task(self._inference.handle("/generate", None, body, picked))

    def end(self, let_in: Any) -> None:
        """The answer of a request let in is over."""
        if self.kind == "picker":
            assert isinstance(let_in, Pick)
            self._picker.release(let_in, True)
        else:
            self._answers.set()


def ids(count: int = 8) -> bytes:
    return json.dumps({"input_ids": [5] * count, "sampling_params": {"max_new_tokens": 1}}).encode()


async def entry(kind: str, lookup: StubLookup | None = None, **settings: Any) -> Entry:
    cluster = Cluster()
    gateway = await make_gateway(cluster, config(**settings), lookup=lookup)
    return Entry(kind, gateway, cluster)


def queued(admission: Admission) -> asyncio.Event:
    """Set once a request starts waiting in `admission`'s queue."""
    event = asyncio.Event()
    admit = admission.admit

    async def watched(waiting: Waiting = None) -> Answer | None:
        async def told() -> None:
            event.set()
            if waiting is not None:
                await waiting()

        return await admit(told)

    admission.admit = watched  # type: ignore[method-assign]
    return event


async def running_first(e: Entry) -> asyncio.Task[Any]:
    """A request that took the one place: for the picker picked, for the gateway at its
    decode."""
    first = e.send(ids())
    if e.kind == "picker":
        await first
    else:
        await e.cluster.wait_calls(2)
    return first


@pytest.mark.parametrize("kind", ENTRIES)
async def test_a_request_under_admission_control_is_looked_up_once_admitted(kind: str) -> None:
    """Not as it comes: a request that waits is placed on what the index shows once its
    turn came, and one the queue refuses costs the index nothing."""
    lookup = StubLookup()
    limits = AdmissionConfig(max_concurrent_requests=1, queue_size=1)
    e = await entry(kind, lookup, admission=limits)
    first = await running_first(e)
    assert len(lookup.asked) == 1
    admission = e.intake.admission
    assert admission is not None
    waits = queued(admission)
    waiting = e.send(ids())
    async with asyncio.timeout(5):
        await waits.wait()
    refused = await e.send(ids())
    assert isinstance(refused, Answer)
    assert refused.status == 429
    assert len(lookup.asked) == 1, "neither the waiting request nor the refused one asked"
    e.end(first.result() if kind == "picker" else first)
    second = await waiting
    assert len(lookup.asked) == 2, "asked once its turn came: the index may show more"
    if kind == "picker":
        assert isinstance(second, Pick)
        e.end(second)
    else:
        assert second.status == 200
        assert (await first).status == 200
    assert admission.running == 0


@pytest.mark.parametrize("kind", ENTRIES)
async def test_a_bad_request_is_the_clients_400_whatever_the_load(kind: str) -> None:
    """Read before admitted: a request that cannot be read is told so, not that the queue
    is full."""
    e = await entry(kind, admission=AdmissionConfig(max_concurrent_requests=1, queue_size=0))
    first = await running_first(e)
    busy = await e.send(ids())
    assert isinstance(busy, Answer)
    assert busy.status == 429
    bad = await e.send(b'{"input_ids": "not ids"}')
    assert isinstance(bad, Answer)
    assert bad.status == 400
    unknown = await e.send(json.dumps({"input_ids": [1], "lora_path": "nobody"}).encode())
    assert isinstance(unknown, Answer)
    assert (unknown.status, json.loads(unknown.body)["error"]["type"]) == (404, "NotFoundError")
    e.end(first.result() if kind == "picker" else first)
    if kind == "gateway":
        await first


@pytest.mark.parametrize("kind", ENTRIES)
async def test_a_request_refused_by_flow_control_holds_nothing(kind: str) -> None:
    flow = FlowConfig(enabled=True)
    limits = AdmissionConfig(max_concurrent_requests=1, queue_size=0)
    e = await entry(kind, admission=limits, flow=flow)
    first = await running_first(e)
    refused = await e.send(ids())
    assert isinstance(refused, Answer)
    assert json.loads(refused.body)["error"]["code"] == "queue_full"
    control = e.gateway.flow
    assert control is not None
    assert (control.running, len(control.queues)) == (1, 0)
    e.end(first.result() if kind == "picker" else first)
    if kind == "gateway":
        await first
    assert control.running == 0
