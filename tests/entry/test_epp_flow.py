"""Flow control in the endpoint picker (gateway/epp/picker.py over gateway/flow/): a
request waits for its turn before it is picked, by priority and tenant from its headers,
asking the data plane for the time that may take, holds its place until its response
ends, and is refused with the limit it met."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    ProcessingRequest,
    ProcessingResponse,
)

from gateway.settings.edge import AdmissionConfig
from gateway.settings.flow import FlowConfig
from gateway.settings.workers import WorkerSpec
from tests.entry.ext_proc import (
    Epp,
    completion,
    limits,
    request,
    response,
    routed,
    serve_epp,
    status,
)
from tests.gateway.fakes import PREFILLS, Cluster, config, make_gateway

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def flow_epp() -> AsyncIterator[Epp]:
    workers = [WorkerSpec(url=u, role="prefill") for u in PREFILLS]
    cfg = config(
        prefill=workers,
        decode=[],
        admission=AdmissionConfig(max_concurrent_requests=1, queue_size=2),
        flow=FlowConfig(enabled=True, objectives=["premium=10", "default=0"]),
    )
    gateway = await make_gateway(Cluster(), cfg)
    async for epp in serve_epp(gateway):
        yield epp


def flow(tenant: str, objective: str | None = None) -> dict[str, str]:
    headers = {"x-gateway-inference-fairness-id": tenant}
    if objective is not None:
        headers["x-llm-d-inference-objective"] = objective
    return headers


async def open_stream(epp: Epp, extra: dict[str, str]) -> Any:
    call = epp.stub.Process()
    for message in request(completion(), extra=extra):
        await call.write(message)
    return call


async def finish(call: Any) -> None:
    """The response ends: the pick's place goes to the next."""
    await call.write(response())
    await call.read()
    await call.write(ProcessingRequest(response_body=HttpBody(body=b"x", end_of_stream=True)))
    await call.read()
    await call.done_writing()


async def test_requests_wait_their_turn_by_priority_before_they_are_picked(flow_epp: Epp) -> None:
    first = await open_stream(flow_epp, flow("a"))
    assert routed(await first.read())[0]
    standard = await open_stream(flow_epp, flow("b"))
    premium = await open_stream(flow_epp, flow("c", "premium"))
    for waiting in (standard, premium):
        assert more_time(await waiting.read()) > 0, "the data plane asked to wait"
    reads = [asyncio.ensure_future(standard.read()), asyncio.ensure_future(premium.read())]
    done, _ = await asyncio.wait(reads, timeout=0.2)
    assert not done, "one place, taken until the first response ends"
    await finish(first)
    done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
    assert done == {reads[1]}, "premium first"
    routed(reads[1].result())
    await finish(premium)
    routed(await reads[0])
    await finish(standard)
    flow_control = flow_epp.gateway.flow
    assert flow_control is not None
    assert (flow_control.running, len(flow_control.queues)) == (0, 0)


async def test_a_full_queue_and_bad_flow_headers_are_refused_saying_why(flow_epp: Epp) -> None:
    first = await open_stream(flow_epp, flow("a"))
    await first.read()
    waiting = [await open_stream(flow_epp, flow("a")) for _ in range(2)]
    answers = await flow_epp.exchange(request(completion(), extra=flow("a")))
    assert status(answers[0]) == 429
    error = json.loads(answers[0].immediate_response.body)["error"]
    assert (error["type"], error["code"]) == ("rate_limit_exceeded", "queue_full")
    assert "--queue-size" in error["message"]
    answers = await flow_epp.exchange(
        request(completion(), extra={"x-gateway-inference-fairness-id": "x" * 300})
    )
    assert status(answers[0]) == 400
    for call in waiting:
        call.cancel()
    await finish(first)


@pytest.mark.parametrize(
    ("header", "value"),
    [
        ("x-llm-d-inference-objective", "NOT A NAME"),
        ("x-gateway-inference-objective", "premium!"),
        ("x-llm-d-slo-ttft-ms", "-1"),
        ("x-slo-ttft-ms", "soon"),
        ("x-llm-d-slo-ttft-ms", "nan"),
        ("x-llm-d-inference-fairness-id", "tab\there"),
    ],
)
async def test_a_flow_header_that_cannot_be_read_is_a_400_naming_it(
    flow_epp: Epp, header: str, value: str
) -> None:
    answers = await flow_epp.exchange(request(completion(), extra={header: value}))
    assert status(answers[0]) == 400
    error = json.loads(answers[0].immediate_response.body)["error"]
    assert header in error["message"]
    flow_control = flow_epp.gateway.flow
    assert flow_control is not None
    assert (flow_control.running, len(flow_control.queues)) == (0, 0), "nothing held"


def more_time(answer: ProcessingResponse) -> float:
    """The seconds an answer asks the data plane to wait for the pick (0: it asks none)."""
    if not answer.HasField("override_message_timeout"):
        return 0.0
    return float(answer.override_message_timeout.ToNanoseconds() / 1e9)


@pytest.mark.parametrize("flow_control", [True, False])
async def test_a_wait_in_a_queue_asks_for_the_time_it_may_take_and_outlasts_the_body_timeout(
    flow_control: bool,
) -> None:
    """Envoy gives up on an answer after its message timeout, and the picker on a body
    after --body-timeout-secs: a request that starts waiting in the flow queues (or the
    admission queue) asks Envoy for the time the wait may take, once, and is picked when
    its turn comes, however long after its body that is."""
    workers = [WorkerSpec(url=u, role="prefill") for u in PREFILLS]
    cfg = config(
        prefill=workers,
        decode=[],
        admission=AdmissionConfig(max_concurrent_requests=1, queue_size=2, queue_timeout_secs=9),
        flow=FlowConfig(enabled=flow_control),
        lookup_timeout_secs=0.5,
    )
    gateway = await make_gateway(Cluster(), cfg)
    async for epp in serve_epp(gateway, limits(gateway, body_secs=0.2)):
        first = await open_stream(epp, flow("a"))
        picked_at_once = await first.read()
        assert more_time(picked_at_once) == 0
        routed(picked_at_once)
        waiting = await open_stream(epp, flow("b"))
        assert more_time(await waiting.read()) == 9 + 0.5 + 1
        picked = asyncio.ensure_future(waiting.read())
        done, _ = await asyncio.wait([picked], timeout=1.0)
        assert not done, "still waiting its turn, five body timeouts later"
        await finish(first)
        routed(await picked)
        await finish(waiting)


async def test_without_flow_control_admission_holds_a_place_until_the_response_ends() -> None:
    workers = [WorkerSpec(url=u, role="prefill") for u in PREFILLS]
    limits = AdmissionConfig(max_concurrent_requests=1, queue_size=0)
    gateway = await make_gateway(Cluster(), config(prefill=workers, decode=[], admission=limits))
    async for epp in serve_epp(gateway):
        first = await open_stream(epp, {})
        routed(await first.read())
        answers = await epp.exchange(request(completion()))
        assert status(answers[0]) == 429
        assert (
            "--max-concurrent-requests"
            in json.loads(answers[0].immediate_response.body)["error"]["message"]
        )
        counted = {
            outcome: epp.registry.get_sample_value(
                "globalkv_epp_requests_total", {"outcome": outcome}
            )
            for outcome in ("queue_full", "shed")
        }
        assert counted == {"queue_full": 1, "shed": None}, "a queue's limit, not shedding"
        await finish(first)
        answers = await epp.exchange(request(completion()))
        assert routed(answers[0])[0]


@pytest.mark.parametrize("flow_control", [True, False])
async def test_a_wait_past_the_queue_timeout_is_a_408_counted_as_such(flow_control: bool) -> None:
    workers = [WorkerSpec(url=u, role="prefill") for u in PREFILLS]
    cfg = config(
        prefill=workers,
        decode=[],
        admission=AdmissionConfig(max_concurrent_requests=1, queue_size=1, queue_timeout_secs=0.2),
        flow=FlowConfig(enabled=flow_control),
    )
    gateway = await make_gateway(Cluster(), cfg)
    async for epp in serve_epp(gateway):
        first = await open_stream(epp, {})
        routed(await first.read())
        answers = await epp.exchange(request(completion()))
        assert more_time(answers[0]) > 0
        assert status(answers[1]) == 408
        assert answers[1].immediate_response.details == "queue_timeout"
        counted = epp.registry.get_sample_value(
            "globalkv_epp_requests_total", {"outcome": "queue_timeout"}
        )
        assert counted == 1
        await finish(first)
