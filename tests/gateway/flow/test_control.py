"""Flow control through the gateway (gateway/flow/): the flow a request's headers name and
the bad ones refused, the settings, the order requests are released in behind a limit,
the 429 and 408 bodies naming their limit, shedding, and the cost when it is off."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from gateway.flow.keys import DEFAULT_TENANT, FlowKeys
from gateway.http.answer import Answer
from gateway.policies.base import Choice
from gateway.requests.bodies import BadRequest
from gateway.serving.inference import Inference
from gateway.settings.edge import AdmissionConfig
from gateway.settings.flow import FlowConfig, parse_objective
from globalkv.cli import main
from tests.gateway.fakes import DECODES, PREFILLS, Cluster, config, make_gateway
from tests.support.clock import FakeClock
from tests.support.net import until

OBJECTIVES = ["premium=10/500", "standard=0", "batch=-1", "default=0"]


def keys(**settings: Any) -> FlowKeys:
    return FlowKeys(FlowConfig(enabled=True, objectives=OBJECTIVES, **settings))


def test_the_tenant_is_the_header_else_the_adapter_else_the_key_else_the_default() -> None:
    k = keys()
    llmd, gie = b"x-llm-d-inference-fairness-id", b"x-gateway-inference-fairness-id"
    assert k.read({llmd: b"acme", gie: b"other"}, "ad", "Bearer s").tenant == "acme"
    assert k.read({gie: b"other"}, "ad", None).tenant == "other"
    assert k.read({}, "ad", "Bearer s").tenant == "lora:ad"
    hashed = k.read({}, None, "Bearer secret-key").tenant
    assert hashed.startswith("key:")
    assert "secret" not in hashed, "an API key is never kept as it is"
    assert hashed != k.read({}, None, "Bearer other-key").tenant
    assert k.read({}, None, None).tenant == DEFAULT_TENANT
    assert k.read({llmd: b""}, None, None).tenant == DEFAULT_TENANT
    custom = keys(fairness_headers=["X-Tenant"])
    assert custom.read({b"x-tenant": b"t1", llmd: b"ignored"}, None, None).tenant == "t1"


@pytest.mark.parametrize(
    "value",
    [b"x" * 257, b"caf\xc3\xa9", b"tab\there", b"a b"],
    ids=["oversize", "not ascii", "control", "space"],
)
def test_fairness_ids_that_are_not_short_visible_ascii_are_refused(value: bytes) -> None:
    with pytest.raises(BadRequest, match="x-llm-d-inference-fairness-id"):
        keys().read({b"x-llm-d-inference-fairness-id": value}, None, None)


def test_the_objective_names_the_priority_and_an_unknown_one_gets_the_default() -> None:
    k = keys()
    premium = k.read({b"x-gateway-inference-objective": b"premium"}, None, None)
    assert (premium.priority, premium.objective, premium.ttft_s) == (10, "premium", 0.5)
    batch = k.read({b"x-llm-d-inference-objective": b"batch"}, None, None)
    assert batch.priority == -1
    unknown = k.read({b"x-llm-d-inference-objective": b"gold"}, None, None)
    assert (unknown.priority, unknown.objective, k.unknown) == (0, "default", 1)
    none_configured = FlowKeys(FlowConfig(enabled=True)).read({}, None, None)
    assert (none_configured.priority, none_configured.ttft_s) == (0, None)
    with pytest.raises(BadRequest, match="InferenceObjective"):
        k.read({b"x-llm-d-inference-objective": b"Premium!"}, None, None)
    with pytest.raises(BadRequest):
        k.read({b"x-llm-d-inference-objective": b"a" * 254}, None, None)


def test_a_requests_own_ttft_overrides_its_objectives_and_must_be_sane() -> None:
    k = keys()
    own = k.read({b"x-llm-d-inference-objective": b"premium", b"x-slo-ttft-ms": b"200"}, None, None)
    assert own.ttft_s == pytest.approx(0.2)
    for bad in (b"-5", b"0", b"nan", b"inf", b"1e12", b"soon"):
        with pytest.raises(BadRequest, match="milliseconds"):
            k.read({b"x-llm-d-slo-ttft-ms": bad}, None, None)


def test_objectives_are_checked_as_inference_objectives() -> None:
    assert parse_objective("premium=10/500").ttft_ms == 500
    assert parse_objective("batch=-1").priority == -1
    assert parse_objective(f"top={2**31 - 1}").priority == 2**31 - 1
    for bad in (f"huge={2**31}", f"tiny={-(2**31) - 1}", "premium", "p=high", "P=1", "p=1/-5"):
        with pytest.raises((ValueError, ValidationError)):
            FlowConfig(objectives=[bad])
    with pytest.raises(ValidationError, match="named twice"):
        FlowConfig(objectives=["a=1", "a=2"])
    with pytest.raises(ValidationError, match="header name"):
        FlowConfig(fairness_headers=["bad header"])


def body(text: str, **extra: Any) -> bytes:
    return json.dumps({"text": text, "sampling_params": {"max_new_tokens": 1}, **extra}).encode()


class Held:
    """Decodes that answer only when the test lets them, recording the order they came."""

    def __init__(self, cluster: Cluster) -> None:
        self.order: list[str] = []
        self.release = asyncio.Event()
        self.arrived = asyncio.Condition()

        async def held(_: httpx.Request, payload: Any) -> httpx.Response:
            self.order.append(payload["text"])
            async with self.arrived:
                self.arrived.notify_all()
            await self.release.wait()
            return httpx.Response(200, json={"room": payload["bootstrap_room"]})

        for url in DECODES:
            cluster.on(url, held)

    async def wait(self, count: int) -> None:
        async with self.arrived:
            await self.arrived.wait_for(lambda: len(self.order) >= count)


async def flow_gateway(
    cluster: Cluster, clock: FakeClock | None = None, **admission: Any
) -> Inference:
    limits = AdmissionConfig(**{"max_concurrent_requests": 1, **admission})
    flow = FlowConfig(enabled=True, objectives=OBJECTIVES)
    gateway = await make_gateway(cluster, config(admission=limits, flow=flow), clock=clock)
    return Inference(gateway)


def send(inference: Inference, text: str, **headers: str) -> asyncio.Task[Answer]:
    picked = tuple((k.encode(), v.encode()) for k, v in headers.items())
    return asyncio.create_task(inference.handle("/generate", None, body(text), picked))


def flow_headers(tenant: str, objective: str | None = None) -> dict[str, str]:
    headers = {"x-llm-d-inference-fairness-id": tenant}
    if objective is not None:
        headers["x-llm-d-inference-objective"] = objective
    return headers


async def test_behind_a_limit_bands_go_first_and_tenants_take_turns() -> None:
    cluster = Cluster()
    held = Held(cluster)
    inference = await flow_gateway(cluster)
    first = send(inference, "first", **flow_headers("a"))
    await held.wait(1)
    waiting = [
        send(inference, "batch", **flow_headers("b", "batch")),
        send(inference, "a1", **flow_headers("a")),
        send(inference, "a2", **flow_headers("a")),
        send(inference, "a3", **flow_headers("a")),
        send(inference, "c1", **flow_headers("c")),
        send(inference, "premium", **flow_headers("p", "premium")),
        send(inference, "c2", **flow_headers("c")),
    ]
    flow = inference._gateway.flow
    assert flow is not None
    await until(lambda: len(flow.queues) == 7, "the seven to wait behind the first")
    assert held.order == ["first"], "one at a time"
    held.release.set()
    answers = await asyncio.gather(first, *waiting)
    assert [a.status for a in answers] == [200] * 8
    # "c" joins the band level with "a" (no credit for having used nothing before): they
    # alternate, "a" first as it has waited longer; the batch band last
    assert held.order == ["first", "premium", "a1", "c1", "a2", "c2", "a3", "batch"]


async def test_refusals_say_which_limit_and_the_lowest_band_is_shed_first() -> None:
    cluster = Cluster()
    held = Held(cluster)
    inference = await flow_gateway(cluster, queue_size=2)
    running = send(inference, "running", **flow_headers("a"))
    await held.wait(1)
    batch = send(inference, "batch", **flow_headers("b", "batch"))
    standard = send(inference, "std", **flow_headers("a"))
    flow = inference._gateway.flow
    assert flow is not None
    await until(lambda: len(flow.queues) == 2, "the two to wait behind the running one")
    second = send(inference, "std2", **flow_headers("a"))  # full: the batch request goes
    shed = await batch
    assert shed.status == 429
    error = json.loads(shed.body)["error"]
    assert (error["code"], error["type"]) == ("shed", "rate_limit_exceeded")
    assert "--queue-size" in error["message"]
    full = await send(inference, "std3", **flow_headers("a"))  # nothing lower, nobody holds more
    assert full.status == 429
    error = json.loads(full.body)["error"]
    assert error["code"] == "queue_full"
    assert "--queue-size" in error["message"]
    assert ("retry-after", "1") in full.headers
    premium = send(inference, "premium", **flow_headers("p", "premium"))
    assert json.loads((await second).body)["error"]["code"] == "shed", "the newest goes"
    held.release.set()
    assert [(await t).status for t in (running, standard, premium)] == [200] * 3
    assert held.order == ["running", "premium", "std"]
    assert flow.refused.labels("shed", "-1")._value.get() == 1
    assert flow.refused.labels("shed", "0")._value.get() == 1
    assert flow.refused.labels("queue_full", "0")._value.get() == 1


async def test_a_wait_past_the_timeout_is_408_and_lets_the_next_go() -> None:
    cluster = Cluster()
    held = Held(cluster)
    inference = await flow_gateway(cluster, queue_timeout_secs=0.05)
    running = send(inference, "running")
    await held.wait(1)
    async with asyncio.timeout(5):  # a limit not held would let it run, held forever
        late = await send(inference, "late")
    assert late.status == 408
    error = json.loads(late.body)["error"]
    assert (error["code"], error["type"]) == ("queue_timeout", "request_timeout")
    assert "--queue-timeout-secs" in error["message"]
    held.release.set()
    assert (await running).status == 200
    assert (await send(inference, "next")).status == 200


async def test_bad_flow_headers_are_the_clients_400() -> None:
    inference = await flow_gateway(Cluster())
    for headers in (
        {"x-llm-d-inference-fairness-id": "x" * 300},
        {"x-gateway-inference-objective": "NOT A NAME"},
        {"x-slo-ttft-ms": "-1"},
    ):
        answer = await send(inference, "bad", **headers)
        assert answer.status == 400, headers
        assert "must" in json.loads(answer.body)["error"]["message"] or "longer" in str(answer.body)


async def test_a_client_leaving_while_it_waits_leaves_the_queue() -> None:
    cluster = Cluster()
    held = Held(cluster)
    inference = await flow_gateway(cluster)
    running = send(inference, "running")
    await held.wait(1)
    gone = send(inference, "gone")
    flow = inference._gateway.flow
    assert flow is not None
    await until(lambda: len(flow.queues) == 1, "the request to wait behind the running one")
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    assert len(flow.queues) == 0
    held.release.set()
    await running
    assert flow.running == 0


async def test_off_nothing_is_built_and_no_header_is_read() -> None:
    gateway = await make_gateway(Cluster(), config(flow=FlowConfig(enabled=False)))
    assert gateway.flow is None
    inference = Inference(gateway)
    assert b"x-llm-d-inference-fairness-id" not in inference._picked


PREFILL_IDS = ("10.0.0.1:30001", "10.0.0.2:30001")


async def headroom_gateway(clock: FakeClock, cluster: Cluster | None = None) -> Inference:
    """Flow control with no limit but headroom: both prefills timed at 1,000 tokens/s."""
    flow = FlowConfig(enabled=True, objectives=OBJECTIVES, reserve_secs=30)
    gateway = await make_gateway(cluster or Cluster(), config(flow=flow), clock=clock)
    loads = gateway.loads
    for worker in PREFILL_IDS:
        ticket = loads.start_prefill(Choice(worker, uncached_tokens=1000))
        clock.advance(1.0)
        loads.finish(ticket)
        assert loads.load(worker).progress.tokens_per_s == pytest.approx(1000)
    return Inference(gateway)


def ids(count: int, **extra: Any) -> bytes:
    return json.dumps({"input_ids": [5] * count, "sampling_params": {"max_new_tokens": 1}}).encode()


def send_ids(inference: Inference, count: int, **headers: str) -> asyncio.Task[Answer]:
    picked = tuple((k.encode(), v.encode()) for k, v in headers.items())
    return asyncio.create_task(inference.handle("/generate", None, ids(count), picked))


async def test_a_request_is_released_once_its_first_token_is_predicted_in_time() -> None:
    clock = FakeClock()
    inference = await headroom_gateway(clock)
    loads = inference._gateway.loads
    # 0.45 s ahead on each
    busy = [loads.start_prefill(Choice(worker, uncached_tokens=450)) for worker in PREFILL_IDS]
    premium = send_ids(inference, 100, **flow_headers("p", "premium"))  # 0.1 s of its own
    flow = inference._gateway.flow
    assert flow is not None
    await until(lambda: premium.done() or len(flow.queues) == 1, "premium to go or wait")
    assert not premium.done(), "0.45 + 0.1 s is past its objective of 0.5 s"
    clock.advance(0.1)  # 0.35 s ahead now
    flow.look()
    assert (await premium).status == 200
    for ticket in busy:
        loads.finish(ticket)


async def test_lower_priorities_leave_room_for_an_active_objective_above() -> None:
    clock = FakeClock()
    inference = await headroom_gateway(clock)
    flow = inference._gateway.flow
    assert flow is not None
    loads = inference._gateway.loads
    assert (await send_ids(inference, 100, **flow_headers("p", "premium"))).status == 200
    # both prefills idle: one standard request leaves the other one to premium
    assert (await send_ids(inference, 1000, **flow_headers("s"))).status == 200
    # one prefill busy for long: a standard request on the idle one would leave premium
    # none that answers within 0.5 s
    busy = [loads.start_prefill(Choice(PREFILL_IDS[1], uncached_tokens=40_000)) for _ in range(2)]
    standard = send_ids(inference, 1000, **flow_headers("s"))
    await until(lambda: standard.done() or len(flow.queues) == 1, "standard to go or wait")
    assert not standard.done()
    clock.advance(29)
    flow.look()  # decides at once: a request it releases leaves the queues
    assert len(flow.queues) == 1, "premium came 29 s ago: still active"
    clock.advance(2)  # 31 s since premium's last request: its headroom is no longer kept
    flow.look()
    assert (await standard).status == 200
    for ticket in busy:
        loads.finish(ticket)


async def test_before_any_rate_is_measured_in_time_means_idle() -> None:
    flow_config = FlowConfig(enabled=True, objectives=OBJECTIVES)
    clock = FakeClock()
    gateway = await make_gateway(Cluster(), config(flow=flow_config), clock=clock)
    inference = Inference(gateway)
    busy = gateway.loads.start_prefill(Choice(PREFILL_IDS[0], uncached_tokens=500))
    assert (await send_ids(inference, 100, **flow_headers("p", "premium"))).status == 200
    other = gateway.loads.start_prefill(Choice(PREFILL_IDS[1], uncached_tokens=500))
    premium = send_ids(inference, 100, **flow_headers("p", "premium"))
    flow = gateway.flow
    assert flow is not None
    await until(lambda: premium.done() or len(flow.queues) == 1, "premium to go or wait")
    assert not premium.done(), "no prefill is idle and none is timed"
    gateway.loads.finish(other)
    flow.look()
    assert (await premium).status == 200
    gateway.loads.finish(busy)


async def test_requests_released_together_do_not_each_find_the_same_room() -> None:
    """Released requests are counted on their prefill until their load is tracked: in one
    pass over the queues, the second must see where the first went."""
    clock = FakeClock()
    cluster = Cluster()
    prefilled = asyncio.Event()
    reached = asyncio.Event()

    async def slow_prefill(_: httpx.Request, __: Any) -> httpx.Response:
        reached.set()
        await prefilled.wait()
        return httpx.Response(200, json={})

    inference = await headroom_gateway(clock, cluster)
    flow = inference._gateway.flow
    assert flow is not None
    loads = inference._gateway.loads
    assert (await send_ids(inference, 100, **flow_headers("p", "premium"))).status == 200
    for url in PREFILLS:
        cluster.on(url, slow_prefill)
    busy = [
        loads.start_prefill(Choice(worker, uncached_tokens=40_000))
        for worker in PREFILL_IDS
        for _ in range(2)
    ]
    waiting = [send_ids(inference, 1000, **flow_headers(f"s{i}")) for i in range(3)]
    await until(lambda: len(flow.queues) == 3, "the three to wait")
    for ticket in busy:
        loads.finish(ticket)  # both prefills idle: room for one, the other kept for premium
    flow.look()
    assert len(flow.queues) == 2
    assert sum(flow.placing.values()) == pytest.approx(1.0)  # 1,000 tokens at 1,000/s
    async with asyncio.timeout(5):
        await reached.wait()
    assert flow.placing == {}, "sent before it reached its prefill: its load is tracked instead"
    flow.look()
    assert len(flow.queues) == 2, "the tracked load holds the others back as the placing did"
    prefilled.set()
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


def test_check_says_what_holds_requests_back(capsys: pytest.CaptureFixture[str]) -> None:
    pd = ["--prefill", "http://10.0.0.1:3", "--decode", "http://10.0.0.2:3"]
    lines = {
        (): "admission: none",
        ("--max-concurrent-requests", "8"): "admission: first come first served, 8 at once",
        ("--flow-control", "--flow-objectives", "premium=10/500", "batch=-1"): (
            "admission: flow control, 3 priority bands, tenants by usage; held by the "
            "prefills' headroom for premium"
        ),
        ("--flow-control",): "held by nothing but a request's own TTFT header",
    }
    for flags, said in lines.items():
        assert main(["--check", "gateway", *pd, *flags]) == 0
        assert said in capsys.readouterr().out
