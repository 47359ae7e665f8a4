"""Choose → inject → send, through httpx.MockTransport with a fake clock and fake sleeps."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from gateway.http.answer import Answer
from gateway.requests.bodies import parse_request
from gateway.serving.service import Gateway
from gateway.settings.workers import BreakerConfig, RetryConfig
from globalkv.lookup import LookupResult, PodHit
from tests.gateway.fakes import (
    DECODES,
    PREFILLS,
    Cluster,
    Reading,
    StubLookup,
    StubProbe,
    config,
    make_gateway,
    request_of,
    rest_of,
    sample,
)
from tests.support.clock import FakeClock, RecordedSleep


async def send(gateway: Gateway, body: dict[str, Any], endpoint: Any = "generate") -> Answer:
    return await gateway.dispatcher.forward(request_of(parse_request(endpoint, body)))


def host(url: str) -> str:
    return url.split("//", 1)[1]


async def test_pair_gets_the_same_bound_body_and_client_gets_the_decode_answer() -> None:
    cluster = Cluster()
    gateway = await make_gateway(cluster)
    answer = await send(gateway, {"text": "hello", "extra": {"keep": True}})
    await gateway.calls.drain()
    assert isinstance(answer, Answer)
    assert answer.status == 200
    prefill, decode = cluster.inference("prefill"), cluster.inference("decode")
    assert len(prefill) == len(decode) == 1
    assert prefill[0].body == decode[0].body
    body = decode[0].body
    assert body["extra"] == {"keep": True}
    assert body["bootstrap_room"] > 0
    chosen = next(u for u in PREFILLS if host(u) == prefill[0].worker)
    assert body["bootstrap_host"] == chosen.split("//")[1].split(":")[0]
    assert body["bootstrap_port"] == (8998 if chosen == PREFILLS[0] else 8999)
    assert json.loads(answer.body)["room"] == body["bootstrap_room"]
    assert all(
        v.in_flight == 0 and v.queued_prefill_tokens == 0 for v in gateway.loads.loads.values()
    )


async def test_prefill_failure_while_decode_waits_retries_with_new_pair_and_rooms() -> None:
    cluster = Cluster()
    cluster.one_prefill_fails(PREFILLS[0], PREFILLS[1])
    sleeps = RecordedSleep()
    # round_robin makes the first attempt go to the broken prefill.
    gateway = await make_gateway(cluster, config(prefill_policy="round_robin"), sleeps=sleeps)
    answer = await send(gateway, {"text": "x"})
    await gateway.calls.drain()
    assert isinstance(answer, Answer)
    assert answer.status == 200
    first, second = cluster.inference("decode")
    assert first.cancelled, "the waiting decode was cancelled when its prefill failed"
    assert first.body["bootstrap_room"] != second.body["bootstrap_room"]
    assert [c.worker for c in cluster.inference("prefill")] == [
        host(PREFILLS[0]),
        host(PREFILLS[1]),
    ]
    assert len(sleeps.delays) == 1
    assert 0.04 <= sleeps.delays[0] <= 0.06
    assert (
        sample(gateway, "globalkv_gateway_retries_total", endpoint="generate", role="prefill") == 1
    )
    p0 = gateway.pool.get(host(PREFILLS[0]))
    assert p0 is not None
    assert p0.breaker.stats().total_failures == 1


async def test_prefill_client_error_is_returned_without_retry() -> None:
    cluster = Cluster()
    never = asyncio.Event()

    async def refusing_prefill(_: httpx.Request, __: Any) -> httpx.Response:
        return httpx.Response(400, json={"error": "bad sampling params"})

    async def waiting_decode(_: httpx.Request, __: Any) -> httpx.Response:
        await never.wait()
        raise AssertionError("unreachable")

    for url in PREFILLS:
        cluster.on(url, refusing_prefill)
    for url in DECODES:
        cluster.on(url, waiting_decode)
    gateway = await make_gateway(cluster)
    answer = await send(gateway, {"text": "x"})
    assert isinstance(answer, Answer)
    assert (answer.status, b"bad sampling params" in answer.body) == (400, True)
    assert len(cluster.inference("prefill")) == 1
    assert cluster.inference("decode")[0].cancelled
    prefill = gateway.pool.get(cluster.inference("prefill")[0].worker)
    assert prefill is not None
    assert prefill.breaker.stats().total_failures == 0


async def test_decode_failure_is_retried_on_the_other_decode_and_noted_on_the_worker() -> None:
    cluster = Cluster()

    async def unavailable(_: httpx.Request, __: Any) -> httpx.Response:
        return httpx.Response(503, text="overloaded")

    async def refused(_: httpx.Request, __: Any) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    cluster.on(DECODES[0], unavailable)
    clock = FakeClock()
    gateway = await make_gateway(cluster, config(decode_policy="round_robin"), clock=clock)
    answer = await send(gateway, {"input_ids": [1, 2, 3]})
    assert isinstance(answer, Answer)
    assert answer.status == 200
    assert [c.worker for c in cluster.inference("decode")] == [host(DECODES[0]), host(DECODES[1])]
    clock.now += 12.5
    shown = gateway.pool.role("decode")[0].describe(gateway.loads, clock())
    assert (shown["last_error"], shown["last_error_age_secs"]) == (
        "decode call answered HTTP 503",
        12.5,
    )
    cluster.on(DECODES[1], refused)
    cluster.on(DECODES[0], unavailable)
    answer = await send(gateway, {"input_ids": [1, 2, 3]})
    assert isinstance(answer, Answer)
    assert answer.status in (502, 503)
    assert (
        sample(
            gateway,
            "globalkv_gateway_upstream_failures_total",
            role="decode",
            reason="ConnectError",
        )
        >= 1
    )
    shown = gateway.pool.role("decode")[1].describe(gateway.loads, clock())
    assert shown["last_error"] == "decode call failed (ConnectError: connection refused)"


async def test_attempts_stop_at_the_limit_with_backoff_between() -> None:
    cluster = Cluster()

    async def unavailable(_: httpx.Request, __: Any) -> httpx.Response:
        return httpx.Response(503, text="busy")

    for url in DECODES:
        cluster.on(url, unavailable)
    sleeps = RecordedSleep()
    retry = RetryConfig(jitter_factor=0)
    gateway = await make_gateway(cluster, config(retry=retry), sleeps=sleeps)
    answer = await send(gateway, {"text": "x"})
    assert isinstance(answer, Answer)
    assert answer.status == 503
    assert len(cluster.inference("decode")) == 5
    assert sleeps.delays == pytest.approx([0.05, 0.075, 0.1125, 0.16875])
    once = await make_gateway(cluster, config(retry=RetryConfig(disabled=True)))
    before = len(cluster.inference("decode"))
    await send(once, {"text": "x"})
    assert len(cluster.inference("decode")) == before + 1


async def test_open_circuit_removes_a_worker_from_candidates() -> None:
    cluster = Cluster()

    async def failing(_: httpx.Request, __: Any) -> httpx.Response:
        return httpx.Response(500, text="boom")

    cluster.on(DECODES[0], failing)
    cfg = config(breaker=BreakerConfig(failure_threshold=2), retry=RetryConfig(disabled=True))
    gateway = await make_gateway(cluster, cfg)
    for _ in range(12):
        await send(gateway, {"text": "x"})
    bad = gateway.pool.get(host(DECODES[0]))
    assert bad is not None
    assert not bad.breaker.allows()
    failures = len([c for c in cluster.inference("decode") if c.worker == host(DECODES[0])])
    assert failures == 2, "no traffic after the circuit opened"
    assert sample(gateway, "globalkv_gateway_breaker_state", worker=bad.id, role="decode") == 1


async def test_no_eligible_prefill_answers_503() -> None:
    cluster = Cluster()
    probe = StubProbe()
    for port in (8998, 8999):
        probe.readings[f"http://10.0.0.{1 if port == 8998 else 2}:{port}"] = Reading(ready=False)
    gateway = await make_gateway(cluster, probe=probe)
    answer = await send(gateway, {"text": "x"})
    assert isinstance(answer, Answer)
    assert answer.status == 503
    assert b"no prefill worker" in answer.body
    assert cluster.inference() == []


async def test_stream_chunks_pass_through_as_they_arrive() -> None:
    cluster = Cluster()
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def chunks() -> AsyncIterator[bytes]:
        while (chunk := await queue.get()) is not None:
            yield chunk

    async def streaming_decode(_: httpx.Request, __: Any) -> httpx.Response:
        return httpx.Response(200, content=chunks(), headers={"content-type": "text/event-stream"})

    for url in DECODES:
        cluster.on(url, streaming_decode)
    gateway = await make_gateway(cluster)
    pending = asyncio.ensure_future(send(gateway, {"text": "x", "stream": True}))
    await queue.put(b"data: 1\n\n")
    stream = await pending
    assert stream.rest is not None
    assert (stream.body, stream.media_type) == (b"data: 1\n\n", b"text/event-stream")
    await queue.put(b"data: 2\n\n")
    assert await stream.rest.next() == b"data: 2\n\n", "chunk 2 arrived before chunk 3 exists"
    await queue.put(b"data: [DONE]\n\n")
    await queue.put(None)
    assert await rest_of(stream) == b"data: [DONE]\n\n"
    await stream.rest.close("done")
    await gateway.calls.drain()
    decode = gateway.pool.get(cluster.inference("decode")[0].worker)
    assert decode is not None
    assert decode.breaker.stats().total_successes == 1
    assert all(v.in_flight == 0 for v in gateway.loads.loads.values())


async def test_stream_prefill_failure_before_first_byte_is_retried() -> None:
    cluster = Cluster()
    gate = asyncio.Event()

    async def failing_prefill(_: httpx.Request, __: Any) -> httpx.Response:
        return httpx.Response(502, text="bad gateway")

    async def ok_prefill(_: httpx.Request, __: Any) -> httpx.Response:
        gate.set()
        return httpx.Response(200, json={})

    async def body() -> AsyncIterator[bytes]:
        await gate.wait()
        yield b"data: tok\n\n"

    async def decode(_: httpx.Request, __: Any) -> httpx.Response:
        return httpx.Response(200, content=body(), headers={"content-type": "text/event-stream"})

    cluster.on(PREFILLS[0], failing_prefill)
    cluster.on(PREFILLS[1], ok_prefill)
    for url in DECODES:
        cluster.on(url, decode)
    gateway = await make_gateway(cluster, config(prefill_policy="round_robin"))
    stream = await send(gateway, {"text": "x", "stream": True})
    assert stream.rest is not None
    assert stream.body == b"data: tok\n\n"
    await stream.rest.close("done")
    assert len(cluster.inference("decode")) == 2


async def test_cancelling_forward_cancels_both_upstream_calls() -> None:
    cluster = Cluster()
    cluster.hang_every_worker()
    gateway = await make_gateway(cluster)
    task = asyncio.ensure_future(send(gateway, {"text": "x"}))
    await cluster.wait_calls(2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await gateway.calls.drain()
    assert [c.cancelled for c in cluster.inference()] == [True, True]
    assert all(
        v.in_flight == 0 and v.queued_prefill_tokens == 0 for v in gateway.loads.loads.values()
    )
    assert all(w.breaker.stats().total_failures == 0 for w in gateway.pool), (
        "not the workers' fault"
    )


async def test_closing_cancels_a_prefill_call_that_outlived_its_request() -> None:
    cluster = Cluster()
    never = asyncio.Event()

    async def hung_prefill(_: httpx.Request, __: Any) -> httpx.Response:
        await never.wait()
        raise AssertionError("unreachable")

    for url in PREFILLS:
        cluster.on(url, hung_prefill)
    gateway = await make_gateway(cluster)
    answer = await send(gateway, {"input_ids": [1, 2]})
    assert isinstance(answer, Answer)
    assert answer.status == 200, "the decode answered; its prefill never did"
    await gateway.close(drain_secs=0)
    assert [c.cancelled for c in cluster.inference("prefill")] == [True]
    assert all(v.in_flight == 0 for v in gateway.loads.loads.values())


async def test_dp_aware_rooms_select_the_rank_holding_the_prefix() -> None:
    cluster = Cluster()
    probe = StubProbe()
    topology = {"dp_size": 4, "follow_bootstrap_room": True}
    probe.readings["http://10.0.0.1:8998"] = Reading(topology=topology)
    probe.readings["http://10.0.0.2:8999"] = Reading(topology=topology)
    result = LookupResult(block_size=4, blocks=3, pods=[PodHit("10.0.0.2:30001", 2, 3, 12, 3.0)])
    gateway = await make_gateway(cluster, probe=probe, lookup=StubLookup(result))
    tokens = list(range(13))
    request = request_of(parse_request("generate", {"input_ids": [tokens, tokens]}))
    await gateway.router.look_up(request.query)
    answer = await gateway.dispatcher.forward(request)
    assert isinstance(answer, Answer)
    body = cluster.inference("prefill")[0].body
    assert cluster.inference("prefill")[0].worker == "10.0.0.2:30001"
    assert len(body["bootstrap_room"]) == 2
    assert all(room % 4 == 2 and room > 0 for room in body["bootstrap_room"])
    assert (
        sample(
            gateway,
            "globalkv_gateway_routing_decisions_total",
            role="prefill",
            policy="prefix",
            outcome="hit",
        )
        == 1
    )


async def test_each_attempt_is_logged_at_debug_with_its_pair_and_rooms(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cluster = Cluster()
    gateway = await make_gateway(cluster)
    with caplog.at_level("DEBUG", logger="gateway.legs.dispatch"):
        answer = await send(gateway, {"text": ["a", "b"]})
    await gateway.calls.drain()
    assert isinstance(answer, Answer)
    body = cluster.inference("decode")[0].body
    (line,) = [r.getMessage() for r in caplog.records if "attempt" in r.getMessage()]
    assert line.startswith("generate attempt 1: prefill=")
    assert f"prefill={cluster.inference('prefill')[0].worker} " in line
    assert f"decode={cluster.inference('decode')[0].worker} " in line
    assert line.endswith("rooms=" + ",".join(str(room) for room in body["bootstrap_room"]))
