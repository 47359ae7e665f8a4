"""Flow control in a decode's sidecar (gateway/sidecar/): the same queues on the same
request path, a request released on the headroom of the prefill its picker named."""

from __future__ import annotations

import asyncio
import json
from random import Random

import httpx
from prometheus_client import CollectorRegistry

from gateway.http.answer import Answer
from gateway.policies.base import Choice
from gateway.requests.headers import PREFILL_HEADER
from gateway.routing.router import Router
from gateway.serving.inference import Inference
from gateway.serving.service import Gateway, build_gateway
from gateway.settings.edge import AdmissionConfig
from gateway.settings.flow import FlowConfig
from gateway.sidecar.chooser import SidecarChooser
from gateway.workers.pool import worker_id
from tests.gateway.fakes import DECODES, Cluster, StubProbe, config
from tests.gateway.flow.test_control import PREFILL_IDS, Held
from tests.support.clock import FakeClock, RecordedSleep
from tests.support.net import until


async def sidecar(cluster: Cluster, clock: FakeClock, **admission: int) -> Gateway:
    cfg = config(
        decode=config().decode[:1],
        admission=AdmissionConfig(**admission),
        flow=FlowConfig(enabled=True, objectives=["premium=10/500"]),
    )
    local = worker_id(DECODES[0])

    def chooser(router: Router) -> SidecarChooser:
        return SidecarChooser(router, local)

    gateway = build_gateway(
        cfg,
        httpx.AsyncClient(transport=httpx.MockTransport(cluster.handler)),
        probe=StubProbe(),
        registry=CollectorRegistry(),
        clock=clock,
        sleep=RecordedSleep(),
        rng=Random(7),
        room_rng=Random(11),
        chooser=chooser,
    )
    await gateway.monitor.run_once(force=True)
    return gateway


def payload(text: str) -> bytes:
    return json.dumps({"text": text, "sampling_params": {"max_new_tokens": 1}}).encode()


async def test_a_sidecar_queues_by_priority_and_tenant() -> None:
    cluster = Cluster()
    held = Held(cluster)
    gateway = await sidecar(cluster, FakeClock(), max_concurrent_requests=1)
    inference = Inference(gateway, named_prefill=True)
    named = (PREFILL_HEADER.encode(), PREFILL_IDS[1].encode())

    def send(text: str, *headers: tuple[bytes, bytes]) -> asyncio.Task[Answer]:
        return asyncio.create_task(
            inference.handle("/generate", None, payload(text), (named, *headers))
        )

    running = send("running")
    await held.wait(1)
    standard = send("standard", (b"x-gateway-inference-fairness-id", b"acme"))
    premium = send("premium", (b"x-llm-d-inference-objective", b"premium"))
    flow = gateway.flow
    assert flow is not None
    await until(lambda: len(flow.queues) == 2, "the two to wait behind the running one")
    held.release.set()
    for task in (running, standard, premium):
        assert (await task).status == 200
    assert held.order == ["running", "premium", "standard"]
    assert {c.worker for c in cluster.inference("prefill")} == {PREFILL_IDS[1]}


async def test_a_sidecars_headroom_is_its_named_prefills() -> None:
    """The request goes to the prefill its picker named: that prefill's work is what
    holds it back, not another prefill's being free."""
    cluster = Cluster()
    clock = FakeClock()
    gateway = await sidecar(cluster, clock)
    loads = gateway.loads
    for worker in PREFILL_IDS:
        ticket = loads.start_prefill(Choice(worker, uncached_tokens=1000))
        clock.advance(1.0)
        loads.finish(ticket)
    busy = [loads.start_prefill(Choice(worker, uncached_tokens=2000)) for worker in PREFILL_IDS]
    inference = Inference(gateway, named_prefill=True)
    headers = (
        (b"x-gateway-inference-objective", b"premium"),
        (PREFILL_HEADER.encode(), PREFILL_IDS[0].encode()),
    )
    ids = json.dumps({"input_ids": [5] * 100, "sampling_params": {"max_new_tokens": 1}})
    premium = asyncio.create_task(inference.handle("/generate", None, ids.encode(), headers))
    flow = gateway.flow
    assert flow is not None
    await until(lambda: premium.done() or len(flow.queues) == 1, "premium to go or wait")
    assert not premium.done(), "2 s of work ahead on every prefill"
    loads.finish(busy[1])
    flow.look()
    assert len(flow.queues) == 1, "the other prefill is free, but the named one has 2 s"
    loads.finish(busy[0])
    flow.look()
    assert (await premium).status == 200
    assert cluster.inference("prefill")[-1].worker == PREFILL_IDS[0], "bound where it was named"


async def test_a_sidecar_refuses_flow_headers_it_cannot_read_naming_them() -> None:
    gateway = await sidecar(Cluster(), FakeClock())
    inference = Inference(gateway, named_prefill=True)
    named = (PREFILL_HEADER.encode(), PREFILL_IDS[0].encode())
    for header, value in (
        (b"x-llm-d-inference-objective", b"NOT A NAME"),
        (b"x-llm-d-slo-ttft-ms", b"0"),
        (b"x-slo-ttft-ms", b"1e12"),
        (b"x-gateway-inference-fairness-id", b"x" * 300),
    ):
        answer = await inference.handle("/generate", None, payload("bad"), (named, (header, value)))
        assert answer.status == 400, header
        assert header.decode() in json.loads(answer.body)["error"]["message"]
    assert gateway.flow is not None
    assert (gateway.flow.running, len(gateway.flow.queues)) == (0, 0)
