"""The request deadline: a 504 naming the PD stage a request stopped in, and a metric.

The deadline is driven by `DeadlineWatch.expire_all()` once the request is where the test
wants it, except in the one test that lets the timer itself fire.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from gateway.http.answer import Answer
from gateway.legs.deadline import DeadlineWatch
from gateway.serving.service import Gateway
from tests.gateway.fakes import DECODES, PREFILLS, Cluster, config, make_gateway, sample
from tests.gateway.test_dispatch import send


async def _hanging(_: httpx.Request, __: Any) -> httpx.Response:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


def _error(answer: Answer) -> dict[str, Any]:
    assert answer.rest is None
    assert answer.status == 504, answer.body
    error: dict[str, Any] = json.loads(answer.body)["error"]
    assert error["type"] == "request_timeout"
    return error


def _timeouts(gateway: Gateway, stage: str) -> float:
    name = "globalkv_gateway_request_timeouts_total"
    return sample(gateway, name, endpoint="generate", stage=stage)


async def test_a_decode_silent_after_its_prefill_answered_is_a_504_at_stage_decode() -> None:
    cluster = Cluster()
    for url in DECODES:
        cluster.on(url, _hanging)
    gateway = await make_gateway(cluster)
    request = asyncio.create_task(send(gateway, {"text": "x"}))
    await cluster.wait_calls(2)
    await gateway.calls.drain()  # the prefill's call has ended: it answered
    gateway.dispatcher.deadlines.expire_all()
    error = _error(await request)
    assert error["stage"] == "decode"
    (decode,) = cluster.inference("decode")
    (prefill,) = cluster.inference("prefill")
    assert error["prefill"] == {"worker": prefill.worker, "answered": 200}
    assert error["decode"] == {"worker": decode.worker, "answer_begun": False}
    assert error["attempt"] == 1
    assert "the prefill had answered HTTP 200" in error["message"]
    assert decode.cancelled, "the decode call was given up"
    assert _timeouts(gateway, "decode") == 1


async def test_both_sides_silent_is_stage_prefill_and_the_prefill_call_is_cancelled() -> None:
    cluster = Cluster()
    cluster.hang_every_worker()
    gateway = await make_gateway(cluster)
    request = asyncio.create_task(send(gateway, {"text": "x"}))
    await cluster.wait_calls(2)
    gateway.dispatcher.deadlines.expire_all()
    error = _error(await request)
    await gateway.calls.drain()
    assert error["stage"] == "prefill"
    assert error["prefill"]["answered"] is None
    assert all(call.cancelled for call in cluster.inference())
    assert _timeouts(gateway, "prefill") == 1


class _HeadOnly(httpx.AsyncByteStream):
    """A streamed answer whose head arrives and whose body never does."""

    def __init__(self, reading: asyncio.Event) -> None:
        self._reading = reading

    async def __aiter__(self) -> AsyncIterator[bytes]:
        self._reading.set()
        await asyncio.Event().wait()
        yield b""


async def test_a_stream_whose_first_byte_never_comes_is_stage_decode_first_byte() -> None:
    cluster = Cluster()
    reading = asyncio.Event()

    async def head_only(_: httpx.Request, __: Any) -> httpx.Response:
        headers = {"content-type": "text/event-stream"}
        return httpx.Response(200, headers=headers, stream=_HeadOnly(reading))

    for url in DECODES:
        cluster.on(url, head_only)
    gateway = await make_gateway(cluster)
    request = asyncio.create_task(send(gateway, {"text": "x", "stream": True}))
    await reading.wait()
    gateway.dispatcher.deadlines.expire_all()
    error = _error(await request)
    assert error["stage"] == "decode_first_byte"
    assert error["decode"]["answer_begun"] is True
    assert _timeouts(gateway, "decode_first_byte") == 1


async def test_a_request_waiting_to_retry_is_stage_retry_backoff() -> None:
    cluster = Cluster()
    backing_off = asyncio.Event()

    async def failing(_: httpx.Request, __: Any) -> httpx.Response:
        return httpx.Response(503, json={"error": "busy"})

    async def endless_sleep(_: float) -> None:
        backing_off.set()
        await asyncio.Event().wait()

    for url in PREFILLS:
        cluster.on(url, failing)
    for url in DECODES:
        cluster.on(url, _hanging)
    gateway = await make_gateway(cluster, sleeps=endless_sleep)  # type: ignore[arg-type]
    request = asyncio.create_task(send(gateway, {"text": "x"}))
    await backing_off.wait()
    gateway.dispatcher.deadlines.expire_all()
    error = _error(await request)
    assert error["stage"] == "retry_backoff"
    assert error["prefill"]["answered"] == 503


async def test_the_deadline_fires_by_itself_after_request_timeout_secs() -> None:
    cluster = Cluster()
    cluster.hang_every_worker()
    gateway = await make_gateway(cluster, config(request_timeout_secs=0.05))
    answers = await asyncio.wait_for(
        asyncio.gather(*(send(gateway, {"text": f"x{i}"}) for i in range(3))), 30
    )
    assert [_error(a)["stage"] for a in answers] == ["prefill"] * 3
    await gateway.calls.drain()


async def test_a_request_that_ends_in_time_is_not_touched_by_its_deadline() -> None:
    cluster = Cluster()
    gateway = await make_gateway(cluster)
    answer = await send(gateway, {"text": "x"})
    gateway.dispatcher.deadlines.expire_all()  # nothing in flight: nothing to expire
    assert isinstance(answer, Answer)
    assert answer.status == 200
    await asyncio.sleep(0)  # a stray cancellation would surface at this suspension
    assert _timeouts(gateway, "prefill") == 0


async def test_a_client_that_leaves_as_the_deadline_passes_still_cancels_the_request() -> None:
    """Two cancellations, the deadline's and the client's: the request must stay cancelled."""
    cluster = Cluster()
    cluster.hang_every_worker()
    gateway = await make_gateway(cluster)
    request = asyncio.create_task(send(gateway, {"text": "x"}))
    await cluster.wait_calls(2)
    gateway.dispatcher.deadlines.expire_all()
    request.cancel()
    try:
        await request
    except asyncio.CancelledError:
        pass
    else:
        raise AssertionError("the client's cancellation was swallowed")
    await gateway.calls.drain()


def test_finished_requests_do_not_pile_up_in_the_watch() -> None:
    async def run() -> int:
        watch = DeadlineWatch(3600)
        for _ in range(1000):
            watch.finish(watch.start())
        left = len(watch._queue)
        watch.close()
        return left

    assert asyncio.run(run()) == 0
