"""Prefill-side clients through httpx.MockTransport, with recorded (never slept) delays."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

import httpx
import pytest

from bootstrap.registrar import (
    SGLANG_JITTER,
    DirectoryRegistrationFailed,
    KeepAlive,
    register_rank,
    register_room_dp_rank,
)
from bootstrap.server import BootstrapConfig, create_app
from kvplumbing.backoff import Backoff
from tests.bootstrap.factories import SGLANG_0_5_23_PUT, registration
from tests.support.clock import FakeClock, RecordedSleep

URL = "http://10.0.0.1:8998"
Handler = Callable[[httpx.Request], httpx.Response]


def scripted(*answers: int | type[httpx.TransportError]) -> tuple[Handler, list[httpx.Request]]:
    """A handler answering each request with the next status, or raising the next error."""
    requests: list[httpx.Request] = []
    queue = list(answers)

    def handle(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        answer = queue.pop(0)
        if isinstance(answer, int):
            return httpx.Response(answer, text="OK" if answer == 200 else f"status {answer}")
        raise answer("boom", request=request)

    return handle, requests


def mock_client(handler: Handler) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def test_backoff_follows_sglang() -> None:
    backoff = Backoff(1.0, 30.0, jitter=SGLANG_JITTER)
    assert [backoff.delay(n, 0.0) for n in range(7)] == [
        0.75,
        1.5,
        3.0,
        6.0,
        12.0,
        22.5,
        22.5,
    ]
    assert backoff.delay(2, 0.999999) == pytest.approx(4.0, rel=1e-5)


async def test_first_try_success_sends_the_whole_registration_once() -> None:
    handler, requests = scripted(200)
    sleep = RecordedSleep()
    async with mock_client(handler) as client:
        await register_rank(
            client, URL, registration(tp=(1, 2), dp=(1, 2), port=40003), sleep=sleep
        )
    [request] = requests
    assert (request.method, str(request.url)) == ("PUT", f"{URL}/route")
    assert json.loads(request.content) == SGLANG_0_5_23_PUT
    assert request.extensions["timeout"]["read"] == 5.0
    assert sleep.delays == []


async def test_transient_failures_are_retried_with_jittered_exponential_backoff() -> None:
    handler, requests = scripted(503, httpx.ConnectError, 500, httpx.ReadTimeout, 200)
    sleep = RecordedSleep()
    async with mock_client(handler) as client:
        await register_rank(client, URL, registration(), sleep=sleep, rand=lambda: 0.5)
    assert len(requests) == 5
    assert sleep.delays == [0.875, 1.75, 3.5, 7.0]


async def test_gives_up_after_the_attempts_naming_url_and_last_error() -> None:
    handler, requests = scripted(*[503] * 4, httpx.ConnectError)
    sleep = RecordedSleep()
    async with mock_client(handler) as client:
        with pytest.raises(DirectoryRegistrationFailed) as info:
            await register_rank(client, URL, registration(), sleep=sleep, rand=lambda: 0.0)
    assert len(requests) == 5
    assert sleep.delays == [0.75, 1.5, 3.0, 6.0]  # no sleep after the last try
    assert str(info.value) == f"registration at {URL} failed: ConnectError: boom (after 5 tries)"
    assert info.value.status is None
    assert info.value.bootstrap_url == URL


async def test_delays_are_capped() -> None:
    handler, _ = scripted(*[503] * 8)
    sleep = RecordedSleep()
    async with mock_client(handler) as client:
        with pytest.raises(DirectoryRegistrationFailed, match="HTTP 503"):
            await register_rank(
                client, URL, registration(), attempts=8, sleep=sleep, rand=lambda: 1.0
            )
    assert sleep.delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


@pytest.mark.parametrize("status", [400, 404, 422])
async def test_a_4xx_refusal_is_not_retried(status: int) -> None:
    handler, requests = scripted(status)
    sleep = RecordedSleep()
    async with mock_client(handler) as client:
        with pytest.raises(DirectoryRegistrationFailed) as info:
            await register_rank(client, URL, registration(), sleep=sleep)
    assert len(requests) == 1
    assert sleep.delays == []
    assert info.value.status == status
    assert f"HTTP {status}: status {status}" in str(info.value)


async def test_a_refusal_from_the_real_directory_names_the_field() -> None:
    app = create_app(BootstrapConfig())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app)) as client:
        await register_rank(client, URL, registration(tp=(0, 2)))
        with pytest.raises(DirectoryRegistrationFailed, match="attn_tp_size=4") as info:
            await register_rank(client, URL, registration(tp=(1, 4)))
    assert info.value.status == 400


async def test_room_dp_rank_registration() -> None:
    handler, requests = scripted(200, 422, httpx.ConnectError)
    async with mock_client(handler) as client:
        await register_room_dp_rank(client, URL, 4611686018427387907, 1)
        with pytest.raises(DirectoryRegistrationFailed, match="HTTP 422") as info:
            await register_room_dp_rank(client, URL, 5, 0)
        assert info.value.status == 422
        with pytest.raises(DirectoryRegistrationFailed, match="ConnectError"):
            await register_room_dp_rank(client, URL, 5, 0)
    assert str(requests[0].url) == f"{URL}/register_dp_rank"
    assert json.loads(requests[0].content) == {"bootstrap_room": 4611686018427387907, "dp_rank": 1}


async def test_keep_alive_refills_a_restarted_directory() -> None:
    """The directory persists nothing: a new app stands for a restarted process."""
    apps = [create_app(BootstrapConfig(), clock=FakeClock()) for _ in range(2)]
    current = {"app": apps[0]}

    async def route(request: httpx.Request) -> httpx.Response:
        transport = httpx.ASGITransport(current["app"])
        return await transport.handle_async_request(request)

    registrations = [registration(**kw) for kw in ({"tp": (0, 2)}, {"tp": (1, 2)})]
    async with httpx.AsyncClient(transport=httpx.MockTransport(route)) as client:
        keep_alive = KeepAlive(client, URL, registrations, interval=5.0)
        assert await keep_alive.tick() == 2
        assert apps[0].state.directory.ready
        current["app"] = apps[1]
        assert not apps[1].state.directory.ready
        assert await keep_alive.tick() == 2
        assert apps[1].state.directory.ready
    assert keep_alive.passes == 2
    assert keep_alive.failures == 0


async def test_keep_alive_logs_when_failing_starts_and_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    handler, _ = scripted(200, 503, 503, 200)
    caplog.set_level(logging.INFO, logger="bootstrap.registrar")
    async with mock_client(handler) as client:
        keep_alive = KeepAlive(client, URL, [registration()])
        assert [await keep_alive.tick() for _ in range(4)] == [1, 0, 0, 1]
    assert keep_alive.failures == 2
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        f"keep-alive at {URL}: DP0 CP0 TP0 PP0: HTTP 503: status 503",
        f"keep-alive at {URL}: directory accepts registrations again",
    ]


async def test_keep_alive_runs_a_pass_per_interval_until_stopped() -> None:
    passes: asyncio.Queue[int] = asyncio.Queue()
    gate: asyncio.Queue[None] = asyncio.Queue()
    delays: list[float] = []

    async def sleep(delay: float) -> None:
        delays.append(delay)
        await gate.get()

    def handle(request: httpx.Request) -> httpx.Response:
        passes.put_nowait(1)
        return httpx.Response(200, text="OK")

    async with mock_client(handle) as client:
        keep_alive = KeepAlive(client, URL, [registration()], interval=2.5, sleep=sleep)
        keep_alive.start()
        with pytest.raises(RuntimeError, match="already started"):
            keep_alive.start()
        for _ in range(3):
            gate.put_nowait(None)
            await asyncio.wait_for(passes.get(), timeout=5)
        await keep_alive.stop()
        await keep_alive.stop()
    assert keep_alive.passes == 3
    assert delays[:3] == [2.5, 2.5, 2.5]


async def test_keep_alive_interval_must_be_positive() -> None:
    async with mock_client(scripted()[0]) as client:
        with pytest.raises(ValueError, match="interval"):
            KeepAlive(client, URL, [], interval=0)
