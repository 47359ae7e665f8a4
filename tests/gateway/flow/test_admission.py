"""Admission control (gateway/flow/admission.py): an exact concurrency limit, an optional rate,
a bounded queue served first come first served, refusals with OpenAI-style bodies; and
through the real server, with request ids and CORS (gateway/serving/edge.py)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from gateway.flow.admission import Admission
from gateway.http.server import HttpServer
from gateway.serving.app import create_app
from gateway.serving.inference import Inference
from gateway.settings.edge import AdmissionConfig, EdgeConfig
from tests.gateway.fakes import DECODES, Cluster, config, make_gateway, rest_of
from tests.support.clock import FakeClock
from tests.support.net import until


def admission(clock: Any = None, **settings: Any) -> Admission:
    config = AdmissionConfig(**{"max_concurrent_requests": 1, **settings})
    return Admission(config, clock or FakeClock(), CollectorRegistry())


def queued(bucket: Admission) -> float:
    """Requests waiting in its queue, as its gauge reads."""
    return bucket.queued.collect()[0].samples[0].value


def done_or_waiting(task: asyncio.Task[Any], bucket: Admission) -> Callable[[], bool]:
    """Whether `task`'s request was answered or waits in `bucket`'s queue, its only one."""
    return lambda: task.done() or queued(bucket) == 1


async def test_waiting_requests_are_served_first_come_first_served() -> None:
    bucket = admission(queue_size=3)
    assert await bucket.admit() is None
    served: list[int] = []

    async def wait(number: int) -> None:
        assert await bucket.admit() is None
        served.append(number)

    waiters = []
    for number in range(3):
        waiters.append(asyncio.create_task(wait(number)))
        await until(lambda n=number: queued(bucket) == n + 1, f"waiter {number} to queue")
    refusal = await bucket.admit()
    assert refusal is not None
    assert refusal.status == 429
    assert ("retry-after", "1") in refusal.headers
    error = json.loads(refusal.body)["error"]
    assert error["type"] == "rate_limit_exceeded"
    assert "--queue-size" in error["message"]
    assert "--max-concurrent-requests" in error["message"]
    for _ in range(3):
        bucket.release()  # grants the next waiter there and then
    await asyncio.gather(*waiters)
    assert served == [0, 1, 2]
    assert bucket.refused.labels("queue_full")._value.get() == 1


async def test_no_queue_refuses_at_once_and_a_long_wait_is_408() -> None:
    bucket = admission(queue_size=0)
    assert await bucket.admit() is None
    refused = await bucket.admit()
    assert refused is not None
    assert refused.status == 429
    waiting = admission(queue_size=1, queue_timeout_secs=0.05)
    assert await waiting.admit() is None
    timed_out = await waiting.admit()
    assert timed_out is not None
    assert timed_out.status == 408
    assert "--queue-timeout-secs" in json.loads(timed_out.body)["error"]["message"]
    waiting.release()
    assert await waiting.admit() is None, "the timed-out request left the queue"


async def test_the_concurrency_limit_holds_however_long_the_requests_run() -> None:
    """The refill that sglang-router's bucket adds on top of the tokens given back let
    the requests running grow by the refill rate each second; here time does not open
    places, only a request ending does, with or without a rate."""
    for rate in (None, 100.0):
        clock = FakeClock()
        bucket = admission(clock, max_concurrent_requests=2, rate_limit_tokens_per_second=rate)
        assert await bucket.admit() is None
        assert await bucket.admit() is None
        clock.advance(3600)
        third = asyncio.create_task(bucket.admit())
        await until(done_or_waiting(third, bucket), "the third to start or wait")
        assert not third.done(), "an hour went by, yet both places are still taken"
        assert bucket.running == 2
        bucket.release()
        assert await third is None
        assert bucket.running == 2


async def test_a_rate_spends_tokens_that_ending_requests_do_not_give_back() -> None:
    bucket = admission(
        time.monotonic, max_concurrent_requests=2, queue_size=1, rate_limit_tokens_per_second=50
    )
    assert await bucket.admit() is None
    assert await bucket.admit() is None
    bucket.release()
    bucket.release()
    assert bucket.running == 0
    async with asyncio.timeout(5):  # a place is free; the token comes from the refill
        assert await bucket.admit() is None
    refusal = admission(
        FakeClock(), max_concurrent_requests=2, queue_size=0, rate_limit_tokens_per_second=0.5
    )
    assert await refusal.admit() is None
    assert await refusal.admit() is None
    refusal.release()
    refused = await refusal.admit()
    assert refused is not None
    assert refused.status == 429
    assert "--rate-limit-tokens-per-second" in json.loads(refused.body)["error"]["message"]
    assert ("retry-after", "2") in refused.headers


def inference_running(inference: Inference) -> int:
    admission = inference.intake.admission
    assert admission is not None
    return admission.running


async def test_a_cancelled_waiter_leaves_the_queue() -> None:
    bucket = admission(queue_size=1)
    assert await bucket.admit() is None
    waiter = asyncio.create_task(bucket.admit())
    await until(lambda: queued(bucket) == 1, "the waiter to queue")
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    bucket.release()
    assert await bucket.admit() is None


async def test_held_requests_never_run_more_than_the_limit_and_streams_hold_their_place() -> None:
    """Through the gateway: eight requests against a limit of two, each decode held until
    the test lets it answer; a streamed answer keeps its place until it is read to its end."""
    cluster = Cluster()
    release = asyncio.Event()
    running = 0
    most = 0

    async def held(_: httpx.Request, body: Any) -> httpx.Response:
        nonlocal running, most
        running += 1
        most = max(most, running)
        try:
            await release.wait()
        finally:
            running -= 1
        return httpx.Response(200, json={"room": body["bootstrap_room"]})

    for url in DECODES:
        cluster.on(url, held)
    clock = FakeClock()
    limits = AdmissionConfig(max_concurrent_requests=2, queue_size=10)
    gateway = await make_gateway(cluster, config(admission=limits), clock=clock)
    inference = Inference(gateway)
    body = json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 1}}).encode()
    requests = [asyncio.create_task(inference.handle("/generate", None, body)) for _ in range(8)]
    await cluster.wait_calls(4)  # two requests, a prefill and a decode each
    clock.advance(3600)
    limit = inference.intake.admission
    assert limit is not None
    await until(lambda: queued(limit) == 6, "the other six to wait")
    assert (running, len(cluster.inference("decode"))) == (2, 2)
    release.set()
    answers = await asyncio.gather(*requests)
    assert [a.status for a in answers] == [200] * 8
    assert most == 2

    streamed = json.dumps({"text": "hi", "stream": True}).encode()
    first = await inference.handle("/generate", None, streamed)
    second = await inference.handle("/generate", None, streamed)
    assert first.rest is not None
    assert second.rest is not None
    third = asyncio.create_task(inference.handle("/generate", None, body))
    await until(done_or_waiting(third, limit), "the third to start or wait")
    assert not third.done(), "both places are held by streams not yet read"
    await rest_of(first)
    await first.rest.close("done")
    assert (await third).status == 200
    await second.rest.close("client_gone")
    assert inference_running(inference) == 0


async def test_through_the_server_shedding_ids_and_cors() -> None:
    cluster = Cluster()
    release = asyncio.Event()
    seen_ids: list[str | None] = []

    async def held(request: httpx.Request, body: Any) -> httpx.Response:
        seen_ids.append(request.headers.get("x-request-id"))
        await release.wait()
        return httpx.Response(200, json={"room": body["bootstrap_room"]})

    for url in DECODES:
        cluster.on(url, held)
    edge = EdgeConfig(cors_allowed_origins=["https://app.example"])
    cfg = config(admission=AdmissionConfig(max_concurrent_requests=1, queue_size=0), edge=edge)
    gateway = await make_gateway(cluster, cfg)
    inference = Inference(gateway)
    server = HttpServer(inference, inference.edge.wrap(create_app(gateway, run_monitor=False)))
    await server.start("127.0.0.1", 0)
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
    origin = {"origin": "https://app.example"}
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as client:
            first = asyncio.create_task(
                client.post("/generate", json=body, headers={"x-correlation-id": "abc-1"})
            )
            await cluster.wait_calls(2)
            shed = await client.post("/generate", json=body, headers=origin)
            assert shed.status_code == 429
            assert shed.json()["error"]["type"] == "rate_limit_exceeded"
            assert shed.headers["x-request-id"].startswith("gnt-")
            assert shed.headers["access-control-allow-origin"] == "https://app.example"
            release.set()
            answer = await first
            assert (answer.status_code, answer.headers["x-request-id"]) == (200, "abc-1")
            assert seen_ids == ["abc-1"]
            assert "access-control-allow-origin" not in answer.headers, "no Origin sent"
            preflight = await client.options(
                "/v1/chat/completions",
                headers={**origin, "access-control-request-method": "POST"},
            )
            assert preflight.status_code == 200
            assert preflight.headers["access-control-allow-origin"] == "https://app.example"
            stranger = await client.get("/health", headers={"origin": "https://evil.example"})
            assert "access-control-allow-origin" not in stranger.headers
            assert stranger.headers["x-request-id"].startswith("req-")
    finally:
        await server.shutdown()
