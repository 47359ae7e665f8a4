"""The gateway's server holds at most `--max-buffered-payload-size` of request bodies.

On real sockets, in-process so the budget can be read: unfinished bodies fill it no
further than its large part, a small request is still served, a body that does not fit is
answered 503 naming the flag (before it is read when its length is announced), one over
the per-request cap still 413; bytes come back when answers end and when clients leave,
requests still arriving or queued behind another included. The same with real gateway and
sidecar processes: `tests/integration/test_body_budget_e2e.py`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import pytest

from gateway.http.server import HttpServer
from gateway.serving.app import create_app
from gateway.serving.inference import Inference
from gateway.serving.service import Gateway
from gateway.settings.config import GatewayConfig
from kvplumbing.budget import BodyBudget
from tests.gateway.fakes import Cluster, config, make_gateway, sample
from tests.gateway.test_server import connected, post, read_answer, until

KiB = 1024
CAP = 512 * KiB
TOTAL = 1024 * KiB
"""Large bodies may hold 896 KiB of it; the last 128 KiB is for bodies of 1 KiB or less."""


@asynccontextmanager
async def serving(gateway: Gateway) -> AsyncIterator[HttpServer]:
    inference = Inference(gateway)
    server = HttpServer(inference, create_app(gateway, run_monitor=False), budget=gateway.bodies)
    await server.start("127.0.0.1", 0)
    try:
        yield server
    finally:
        await server.shutdown(grace=5)


async def budgeted() -> Gateway:
    return await make_gateway(
        Cluster(), config(max_payload_size=CAP, max_buffered_payload_size=TOTAL)
    )


def head(length: int | None, *extra: str) -> bytes:
    framing = "transfer-encoding: chunked" if length is None else f"content-length: {length}"
    lines = ["POST /v1/completions HTTP/1.1", "host: gw", framing, *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def held(gateway: Gateway) -> float:
    return sample(gateway, "globalkv_gateway_request_body_bytes")


async def test_unfinished_bodies_fill_the_budget_no_further_and_a_small_request_is_served() -> None:
    gateway = await budgeted()
    budget = gateway.bodies
    async with serving(gateway) as server, AsyncExitStack() as clients:
        # Two bodies of 448 KiB, each a KiB short of its end, take nearly all a large body
        # may (896 KiB).
        for number in range(2):
            _, writer = await clients.enter_async_context(connected(server))
            writer.write(head(448 * KiB) + b"x" * (447 * KiB))
            await until(lambda n=number: budget.used == (n + 1) * 447 * KiB, "the body taken")
        assert held(gateway) == 894 * KiB
        # A third, by length, is refused before it is read; chunked, as it arrives.
        reader, writer = await clients.enter_async_context(connected(server))
        writer.write(head(64 * KiB, "expect: 100-continue"))
        status, headers, body = await read_answer(reader)
        assert (status, headers["connection"]) == (503, "close")
        error = json.loads(body)["error"]
        assert error["type"] == "overloaded"
        assert f"--max-buffered-payload-size ({TOTAL} bytes)" in error["message"]
        assert await reader.read() == b"", "closed, and no 100 Continue before it"
        reader, writer = await clients.enter_async_context(connected(server))
        writer.write(head(None) + b"%x\r\n%s\r\n" % (4 * KiB, b"y" * 4 * KiB))
        assert (await read_answer(reader))[0] == 503
        assert budget.used == 894 * KiB, "the refused body gave back what it took"
        # An ordinary request takes the reserve and is answered.
        reader, writer = await clients.enter_async_context(connected(server))
        writer.write(post("/v1/completions", {"prompt": "hello", "max_tokens": 2}))
        assert (await read_answer(reader))[0] == 200
        assert budget.peak <= budget.largest + budget.small
    # The clients left with their bodies unfinished: every byte is back.
    await until(lambda: budget.used == 0, "the bodies given back")
    assert held(gateway) == 0
    labels = {"endpoint": "completions", "status": "503"}
    assert sample(gateway, "globalkv_gateway_requests_total", **labels) == 2


async def test_one_body_over_the_cap_is_413_even_with_room_in_the_budget() -> None:
    gateway = await budgeted()
    async with serving(gateway) as server, connected(server) as (reader, writer):
        writer.write(head(CAP + 1))
        status, _, body = await read_answer(reader)
        assert status == 413
        assert b"--max-payload-size" in body
    assert gateway.bodies.used == 0


async def test_bodies_are_held_while_served_and_given_back_when_answered() -> None:
    cluster = Cluster()
    release = asyncio.Event()
    cluster.hold_decodes(release)
    gateway = await make_gateway(
        cluster, config(max_payload_size=CAP, max_buffered_payload_size=TOTAL)
    )
    first = post("/generate", {"text": "a" * 300})
    second = post("/generate", {"text": "b" * 500})
    sizes = [len(r.partition(b"\r\n\r\n")[2]) for r in (first, second)]
    async with serving(gateway) as server, connected(server) as (reader, writer):
        writer.write(first + second)  # the second waits behind the first, its body held
        await cluster.wait_calls(2)
        await until(lambda: gateway.bodies.used == sum(sizes), "both bodies held")
        release.set()
        assert [(await read_answer(reader))[0] for _ in range(2)] == [200, 200]
        await until(lambda: gateway.bodies.used == 0, "both given back once answered")


async def test_a_client_leaving_gives_back_the_bodies_queued_behind_its_request() -> None:
    cluster = Cluster()
    cluster.hang_every_worker()
    gateway = await make_gateway(
        cluster, config(max_payload_size=CAP, max_buffered_payload_size=TOTAL)
    )
    async with serving(gateway) as server:
        async with connected(server) as (_, writer):
            queued = post("/generate", {"text": "q" * 1000})
            writer.write(post("/generate", {"text": "x"}) + queued * 3 + head(CAP) + b"z" * 999)
            await cluster.wait_calls(2)
            await until(lambda: gateway.bodies.used > 3 * 1000, "the queued bodies held")
        await until(lambda: gateway.bodies.used == 0, "every body given back")
        await gateway.calls.drain()


def test_the_total_defaults_to_twice_the_cap_and_must_hold_one_body_at_the_cap() -> None:
    MiB = 1024 * KiB
    assert GatewayConfig().body_budget == 1024 * MiB
    assert GatewayConfig(max_payload_size=MiB, max_buffered_payload_size=32 * MiB).body_budget == (
        32 * MiB
    )
    with pytest.raises(ValueError, match="--max-buffered-payload-size 8388608 holds a body"):
        GatewayConfig(max_payload_size=8 * MiB, max_buffered_payload_size=8 * MiB)
    config = GatewayConfig(max_payload_size=7 * MiB, max_buffered_payload_size=8 * MiB)
    assert BodyBudget(config.body_budget).largest == 7 * MiB
