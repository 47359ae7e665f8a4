"""What a picker's streams may hold: request bodies bounded per process, deadlines on
bodies and on picks, so streams held open cannot starve real picks; and fresh prompts
held in flight spread by load."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3.external_processor_pb2 import HttpBody, ProcessingRequest

from gateway.settings.workers import WorkerSpec
from tests.entry.ext_proc import (
    BUFFERED,
    DUPLEX,
    Epp,
    completion,
    limits,
    request,
    response,
    routed,
    serve_epp,
    status,
)
from tests.gateway.fakes import PREFILLS, Cluster, StubLookup, config, make_gateway
from tests.support.net import await_for

pytestmark = pytest.mark.timeout(30)


async def _opened(epp: Epp, messages: list[ProcessingRequest]) -> Any:
    """A stream with `messages` written and left open."""
    call = epp.stub.Process()
    for message in messages:
        await call.write(message)
    return call


async def _until(epp: Epp, condition: Callable[[Epp], bool], what: str) -> None:
    async def now() -> bool:
        return condition(epp)

    await await_for(now, timeout=10, what=what)


def _unfinished(size: int) -> list[ProcessingRequest]:
    """Headers and the first `size` bytes of a body that never ends (FULL_DUPLEX_STREAMED)."""
    first = request(b"", mode=DUPLEX)[0]
    return [first, ProcessingRequest(request_body=HttpBody(body=b"x" * size))]


async def _picker(**stream_limits: Any) -> Any:
    workers = [WorkerSpec(url=u, role="prefill") for u in PREFILLS]
    gateway = await make_gateway(Cluster(), config(prefill=workers, decode=[]))
    return serve_epp(gateway, limits(gateway, **stream_limits), shed_in_flight=2)


async def test_unfinished_large_bodies_are_bounded_per_process_with_a_503() -> None:
    piece = 300_000
    async for epp in await _picker(buffered_bytes=1_000_000):
        held = [await _opened(epp, _unfinished(piece)) for _ in range(3)]
        await _until(epp, lambda e: e.buffered() == 3 * piece, "three bodies held")
        refused = await _opened(epp, _unfinished(piece))
        answer = await refused.read()
        assert status(answer) == 503
        assert b"--max-buffered-bytes (1000000 bytes)" in answer.immediate_response.body
        assert answer.immediate_response.details == "bodies_full"
        assert epp.buffered() == 3 * piece
        # a small body still fits, and streams still receiving a body hold no load
        answers = await epp.exchange(request(completion(), mode=BUFFERED))
        assert routed(answers[-1])[0]
        for call in held:
            call.cancel()
        await _until(epp, lambda e: e.buffered() == 0, "the bodies given back")


async def test_a_body_that_does_not_arrive_in_time_is_408_and_dropped() -> None:
    async for epp in await _picker(body_secs=0.2):
        call = await _opened(epp, _unfinished(1000))
        answer = await call.read()
        assert status(answer) == 408
        assert await call.read() is grpc.aio.EOF
        counted = epp.registry.get_sample_value(
            "globalkv_epp_requests_total", {"outcome": "body_timeout"}
        )
        assert counted == 1


async def test_streams_still_receiving_a_body_hold_no_load() -> None:
    async for epp in await _picker():
        held = [await _opened(epp, _unfinished(100)) for _ in range(20)]  # shed at 2 x 2
        answers = await epp.exchange(request(completion(), mode=BUFFERED))
        assert routed(answers[-1])[0]
        for call in held:
            call.cancel()


async def test_picks_held_open_past_the_pick_timeout_stop_counting_and_real_picks_route() -> None:
    async for epp in await _picker(pick_secs=0.5):
        held, shed = [], 0
        for _ in range(20):  # far past 2 in flight on each of the two workers
            call = await _opened(epp, request(completion(), mode=BUFFERED))
            assert (await call.read()).HasField("request_headers")
            answer = await call.read()
            if status(answer) == 429:
                shed += 1
            else:
                assert routed(answer)[0]
                held.append(call)
        assert (len(held), shed) == (4, 16)
        for call in held:  # the picker ends each held stream once its pick expired
            assert await call.read() is grpc.aio.EOF
        assert sum(epp.in_flight(u.split("//", 1)[1]) for u in PREFILLS) == 0
        answers = await epp.exchange(request(completion(), mode=BUFFERED))
        assert routed(answers[-1])[0]


@pytest.mark.parametrize("settled", [False, True], ids=["held", "answered"])
async def test_fresh_prompts_held_in_flight_spread_evenly_over_the_pods(settled: bool) -> None:
    """Nine prompts nobody holds, each held in flight (`settled`: its response's headers
    came, so its prefill is done and only the request remains in flight)."""
    urls = [*PREFILLS, "http://10.0.0.3:30001"]
    workers = [WorkerSpec(url=u, role="prefill") for u in urls]
    gateway = await make_gateway(Cluster(), config(prefill=workers, decode=[]), lookup=StubLookup())
    async for epp in serve_epp(gateway):
        chosen, held = [], []
        for i in range(9):
            prompt = completion(prompt=[100 + i] * 48)
            call = await _opened(epp, request(prompt, mode=BUFFERED))
            await call.read()
            chosen.append(routed(await call.read())[0])
            if settled:
                await call.write(response())
                await call.read()
            held.append(call)
        assert sorted(collections.Counter(chosen).values()) == [3, 3, 3]
        for call in held:
            await call.done_writing()
