"""The gateway's own HTTP server on real sockets: what only a server can get right.

Routes, bodies and answers are the same through the ASGI app and this server and are
tested through both in `test_app.py`; here: keep-alive and pipelining, limits enforced
before reading, `Expect: 100-continue`, clients that leave, streams piece by piece,
HTTP/1.0, malformed requests, Upgrade headers, idle and slow clients (time passed to
`HttpServer.expire`, not waited for), clients that do not read their answers, and a
graceful shutdown.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from gateway.http.client_connection import HEAD_MAX
from gateway.http.server import HttpServer
from gateway.serving.app import create_app
from gateway.serving.inference import Inference
from gateway.serving.service import Gateway
from kvplumbing.release import VERSION
from tests.gateway.fakes import DECODES, Cluster, config, make_gateway, sample
from tests.support.net import await_for


@asynccontextmanager
async def serving(gateway: Gateway, **options: Any) -> AsyncIterator[HttpServer]:
    server = HttpServer(Inference(gateway), create_app(gateway, run_monitor=False), **options)
    await server.start("127.0.0.1", 0)
    try:
        yield server
    finally:
        await server.shutdown(grace=5)


def post(path: str, body: dict[str, Any], *extra: str) -> bytes:
    data = json.dumps(body).encode()
    head = [f"POST {path} HTTP/1.1", "host: gw", f"content-length: {len(data)}", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + data


GET_HEALTH = b"GET /health HTTP/1.1\r\nhost: gw\r\n\r\n"


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    lines = head.split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):
            body += (await reader.readexactly(size + 2))[:-2]
        await reader.readexactly(2)
        return status, headers, body
    return status, headers, await reader.read()


async def read_chunk(reader: asyncio.StreamReader) -> bytes:
    size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
    return (await reader.readexactly(size + 2))[:-2]


@asynccontextmanager
async def connected(
    server: HttpServer,
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        yield reader, writer
    finally:
        writer.close()


async def until(check: Callable[[], bool], what: str) -> None:
    async def condition() -> bool:
        return check()

    await await_for(condition, timeout=10, what=what)


async def test_pipelined_requests_on_one_connection_are_answered_in_order() -> None:
    gateway = await make_gateway(Cluster())
    async with serving(gateway) as server, connected(server) as (reader, writer):
        writer.write(
            post("/generate", {"input_ids": [1]}) + GET_HEALTH + post("/generate", {"text": "x"})
        )
        answers = [await read_answer(reader) for _ in range(3)]
        writer.write(GET_HEALTH)
        answers.append(await read_answer(reader))
    assert [a[0] for a in answers] == [200, 200, 200, 200]
    assert "room" in json.loads(answers[0][2])
    assert json.loads(answers[1][2]) == {"status": "ok", "version": VERSION}
    assert "room" in json.loads(answers[2][2])


async def test_an_oversized_body_is_refused_before_it_is_read_and_counted() -> None:
    gateway = await make_gateway(Cluster(), config(max_payload_size=100))
    async with serving(gateway) as server:
        async with connected(server) as (reader, writer):
            writer.write(b"POST /generate HTTP/1.1\r\nhost: gw\r\ncontent-length: 1000000\r\n\r\n")
            status, headers, body = await read_answer(reader)
            assert (status, headers["connection"]) == (413, "close")
            assert b"max-payload-size (100 bytes)" in body
            assert await reader.read() == b"", "the connection is closed"
        async with connected(server) as (reader, writer):
            head = (
                b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ntransfer-encoding: chunked\r\n\r\n"
            )
            writer.write(head + b"80\r\n" + b"x" * 128 + b"\r\n")
            assert (await read_answer(reader))[0] == 413
    assert sample(gateway, "globalkv_gateway_requests_total", endpoint="generate", status="413")
    assert sample(gateway, "globalkv_gateway_requests_total", endpoint="completions", status="413")


async def test_expect_100_continue_is_answered_before_the_body_is_sent() -> None:
    gateway = await make_gateway(Cluster())
    async with serving(gateway) as server, connected(server) as (reader, writer):
        whole = post("/generate", {"input_ids": [1, 2]}, "expect: 100-continue")
        head, _, body = whole.partition(b"\r\n\r\n")
        writer.write(head + b"\r\n\r\n")
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(body)
        assert (await read_answer(reader))[0] == 200


async def test_a_client_that_leaves_cancels_both_upstream_calls() -> None:
    cluster = Cluster()
    cluster.hang_every_worker()
    gateway = await make_gateway(cluster)
    async with serving(gateway) as server:
        async with connected(server) as (_, writer):
            writer.write(post("/generate", {"text": "x"}))
            await cluster.wait_calls(2)

        def gone() -> bool:
            labels = {"endpoint": "generate", "status": "499"}
            return sample(gateway, "globalkv_gateway_requests_total", **labels) == 1

        await until(gone, "the request counted as 499")
        await gateway.calls.drain()
    assert [c.cancelled for c in cluster.inference()] == [True, True]
    assert all(w.breaker.stats().total_failures == 0 for w in gateway.pool)


async def test_a_stream_arrives_piece_by_piece_and_a_client_leaving_mid_stream_ends_it() -> None:
    cluster = Cluster()
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    ended = asyncio.Event()

    async def pieces() -> AsyncIterator[bytes]:
        try:
            while True:
                yield await queue.get()
        finally:
            ended.set()

    async def decode(_: httpx.Request, __: Any) -> httpx.Response:
        return httpx.Response(200, content=pieces(), headers={"content-type": "text/event-stream"})

    for url in DECODES:
        cluster.on(url, decode)
    gateway = await make_gateway(cluster)
    async with serving(gateway) as server:
        async with connected(server) as (reader, writer):
            writer.write(post("/generate", {"text": "x", "stream": True}))
            await queue.put(b"data: 1\n\n")
            head = await reader.readuntil(b"\r\n\r\n")
            assert b"transfer-encoding: chunked" in head
            assert b"content-type: text/event-stream" in head
            assert await read_chunk(reader) == b"data: 1\n\n"
            await queue.put(b"data: 2\n\n")
            assert await read_chunk(reader) == b"data: 2\n\n", "before piece 3 exists"
        await asyncio.wait_for(ended.wait(), 10)
        await gateway.calls.drain()
    assert all(v.in_flight == 0 for v in gateway.loads.loads.values())
    assert all(w.breaker.stats().total_failures == 0 for w in gateway.pool)


async def test_a_stream_cut_short_upstream_ends_without_its_last_chunk() -> None:
    cluster = Cluster()

    async def broken() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        raise httpx.ReadError("the decode died")

    async def decode(_: httpx.Request, __: Any) -> httpx.Response:
        return httpx.Response(200, content=broken(), headers={"content-type": "text/event-stream"})

    for url in DECODES:
        cluster.on(url, decode)
    gateway = await make_gateway(cluster)
    async with serving(gateway) as server, connected(server) as (reader, writer):
        writer.write(post("/generate", {"text": "x", "stream": True}))
        await reader.readuntil(b"\r\n\r\n")
        assert await read_chunk(reader) == b"data: 1\n\n"
        assert await reader.read() == b"", "closed, no 0-length chunk"


async def test_http_1_0_gets_its_answer_and_a_closed_connection() -> None:
    gateway = await make_gateway(Cluster())
    async with serving(gateway) as server:
        for body in ({"input_ids": [1]}, {"input_ids": [1], "stream": True}):
            async with connected(server) as (reader, writer):
                writer.write(post("/generate", body).replace(b"HTTP/1.1", b"HTTP/1.0", 1))
                status, headers, content = await read_answer(reader)
                assert (status, headers["connection"]) == (200, "close")
                assert "transfer-encoding" not in headers
                assert b"room" in content
                assert await reader.read() == b""


async def test_http_1_0_keep_alive_is_answered_as_such_and_kept() -> None:
    gateway = await make_gateway(Cluster())
    requests = [
        post("/generate", {"input_ids": [1]}, "connection: keep-alive"),
        b"GET /health HTTP/1.1\r\nhost: gw\r\nconnection: keep-alive\r\n\r\n",
    ]
    async with serving(gateway) as server, connected(server) as (reader, writer):
        for request in requests:
            writer.write(request.replace(b"HTTP/1.1", b"HTTP/1.0", 1))
            status, headers, _ = await read_answer(reader)
            assert (status, headers["connection"]) == (200, "keep-alive")


async def test_a_malformed_request_gets_400_and_a_closed_connection() -> None:
    gateway = await make_gateway(Cluster())
    async with serving(gateway) as server, connected(server) as (reader, writer):
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        status, _, body = await read_answer(reader)
        assert status == 400
        assert b"malformed HTTP request" in body


async def test_idle_keep_alive_connections_are_closed() -> None:
    gateway = await make_gateway(Cluster())
    async with (
        serving(gateway, keep_alive_secs=0.1) as server,
        connected(server) as (reader, writer),
    ):
        writer.write(GET_HEALTH)
        assert (await read_answer(reader))[0] == 200
        assert await asyncio.wait_for(reader.read(), 10) == b""


async def test_shutdown_finishes_what_is_in_flight_and_takes_nothing_new() -> None:
    cluster = Cluster()
    release = asyncio.Event()
    cluster.hold_decodes(release)
    gateway = await make_gateway(cluster)
    async with serving(gateway) as server:
        port = server.port
        async with connected(server) as (reader, writer), connected(server) as (idle, _):
            writer.write(post("/generate", {"input_ids": [1]}))
            await cluster.wait_calls(2)
            stopping = asyncio.ensure_future(server.shutdown(grace=10))
            assert await asyncio.wait_for(idle.read(), 10) == b"", "idle connections close"
            with pytest.raises(ConnectionRefusedError):
                await asyncio.open_connection("127.0.0.1", port)
            release.set()
            status, headers, _ = await read_answer(reader)
            assert (status, headers["connection"]) == (200, "close")
            await asyncio.wait_for(stopping, 10)


async def test_shutdown_aborts_what_is_still_in_flight_when_the_grace_runs_out() -> None:
    cluster = Cluster()
    release = asyncio.Event()
    cluster.hold_decodes(release)
    gateway = await make_gateway(cluster)
    async with serving(gateway) as server:
        async with connected(server) as (reader, writer):
            writer.write(post("/generate", {"input_ids": [1]}))
            await cluster.wait_calls(2)
            await asyncio.wait_for(server.shutdown(grace=0.05), 10)
            assert not server.connections
            assert await asyncio.wait_for(reader.read(), 10) == b"", "aborted, no answer"
        release.set()


def arriving(server: HttpServer) -> bool:
    """Some connection holds a request that has not fully arrived."""
    return any(not c.idle for c in server.connections)


async def test_a_request_that_stops_arriving_gets_408_and_a_closed_connection() -> None:
    gateway = await make_gateway(Cluster())
    async with serving(gateway, read_timeout_secs=30) as server:
        for partial in (
            b"POST /generate HTTP/1.1\r\nhost: gw\r\n",  # a head that never ends
            b"POST /generate HTTP/1.1\r\nhost: gw\r\ncontent-length: 10\r\n\r\n{",
        ):
            async with connected(server) as (reader, writer):
                writer.write(partial)
                await until(lambda: arriving(server), "the request begun")
                now = asyncio.get_running_loop().time()
                server.expire(now + 29)
                assert arriving(server), "still within its time"
                server.expire(now + 31)
                status, headers, body = await read_answer(reader)
                assert (status, headers["connection"]) == (408, "close")
                assert b"did not arrive within 30 s" in body
                assert await reader.read() == b""


async def test_a_head_trickled_in_is_timed_from_its_first_byte() -> None:
    gateway = await make_gateway(Cluster())
    async with (
        serving(gateway, read_timeout_secs=30) as server,
        connected(server) as (reader, writer),
    ):
        writer.write(b"GET /health HTTP/1.1\r\n")
        await until(lambda: arriving(server), "the request begun")
        first = asyncio.get_running_loop().time()
        (connection,) = server.connections
        writer.write(b"x-slow: 1\r\n")
        await until(lambda: connection.last_active > first, "the second piece read")
        server.expire(first + 31)
        assert (await read_answer(reader))[0] == 408


async def test_a_head_larger_than_the_limit_gets_431_and_a_closed_connection() -> None:
    gateway = await make_gateway(Cluster())
    async with serving(gateway) as server, connected(server) as (reader, writer):
        writer.write(b"GET /health HTTP/1.1\r\nx-big: ")
        await until(lambda: arriving(server), "the request begun")
        for _ in range(2 * HEAD_MAX // 4096 + 2):
            writer.write(b"a" * 4096)
            await writer.drain()
            await asyncio.sleep(0)
        status, headers, body = await read_answer(reader)
        assert (status, headers["connection"]) == (431, "close")
        assert b"exceed 64 KiB" in body


async def test_an_upgrade_request_is_served_over_http_1_1_with_its_body() -> None:
    gateway = await make_gateway(Cluster())
    upgrade = "connection: Upgrade, HTTP2-Settings", "upgrade: h2c", "http2-settings: AAMAAABk"
    async with serving(gateway) as server, connected(server) as (reader, writer):
        head, _, body = post("/generate", {"input_ids": [1, 2]}, *upgrade).partition(b"\r\n\r\n")
        writer.write(head + b"\r\n\r\n" + body[:3])
        await until(lambda: arriving(server), "the head read")
        writer.write(body[3:] + GET_HEALTH)
        status, _, answer = await read_answer(reader)
        assert (status, "room" in json.loads(answer)) == (200, True)
        status, _, health = await read_answer(reader)
        assert (status, json.loads(health)) == (200, {"status": "ok", "version": VERSION})
    async with serving(gateway) as server, connected(server) as (reader, writer):
        writer.write(b"CONNECT gw:443 HTTP/1.1\r\nhost: gw:443\r\n\r\n")
        assert (await read_answer(reader))[0] == 405
    async with serving(gateway) as server, connected(server) as (reader, writer):
        chunked = b"POST /generate HTTP/1.1\r\nhost: gw\r\nconnection: upgrade\r\nupgrade: h2c\r\n"
        writer.write(chunked + b"transfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
        status, _, answer = await read_answer(reader)
        assert (status, b"chunked body with an Upgrade header" in answer) == (400, True)


async def test_a_client_not_reading_its_answers_is_sent_no_more_until_it_reads() -> None:
    cluster = Cluster()
    big = b"x" * (8 * 1024 * 1024)
    servers: list[HttpServer] = []
    started_while_paused: list[bool] = []

    async def large(_: httpx.Request, __: Any) -> httpx.Response:
        started_while_paused.append(any(c.write_paused for c in servers[0].connections))
        return httpx.Response(200, content=big, headers={"content-type": "text/plain"})

    for url in DECODES:
        cluster.on(url, large)
    gateway = await make_gateway(cluster)
    async with serving(gateway) as server:
        servers.append(server)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        sock.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=sock)
        try:
            writer.write(b"".join(post("/generate", {"input_ids": [i]}) for i in range(3)))
            await until(lambda: any(c.write_paused for c in server.connections), "paused")
            for _ in range(3):
                assert (await read_answer(reader))[2] == big
        finally:
            writer.close()
    assert started_while_paused == [False, False, False]


async def test_shutdown_drops_a_request_still_arriving_at_once() -> None:
    gateway = await make_gateway(Cluster())
    async with serving(gateway) as server, connected(server) as (reader, writer):
        writer.write(b"POST /generate HTTP/1.1\r\nhost: gw\r\n")
        await until(lambda: arriving(server), "the request begun")
        stopping = asyncio.ensure_future(server.shutdown(grace=60))
        assert await asyncio.wait_for(reader.read(), 10) == b"", "closed, not kept for the grace"
        await asyncio.wait_for(stopping, 10)


async def test_a_large_body_refused_unread_still_gets_its_413() -> None:
    gateway = await make_gateway(Cluster(), config(max_payload_size=100))
    async with (
        serving(gateway) as server,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as client,
    ):
        for _ in range(3):
            response = await client.post("/generate", content=b"x" * 4_000_000)
            assert response.status_code == 413


async def test_a_pipelined_request_expecting_100_continue_gets_it_when_it_is_next() -> None:
    cluster = Cluster()
    release = asyncio.Event()
    cluster.hold_decodes(release)
    gateway = await make_gateway(cluster)
    async with serving(gateway) as server, connected(server) as (reader, writer):
        head, _, body = post("/generate", {"input_ids": [2]}, "expect: 100-continue").partition(
            b"\r\n\r\n"
        )
        writer.write(post("/generate", {"input_ids": [1]}) + head + b"\r\n\r\n")
        await cluster.wait_calls(2)
        release.set()
        assert (await read_answer(reader))[0] == 200
        continued = reader.readuntil(b"\r\n\r\n")
        assert await asyncio.wait_for(continued, 10) == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(body)
        assert (await read_answer(reader))[0] == 200


async def test_at_the_connection_cap_the_connection_idle_longest_makes_room() -> None:
    gateway = await make_gateway(Cluster())
    async with (
        serving(gateway, max_connections=2) as server,
        connected(server) as (first, first_writer),
        connected(server) as (second, second_writer),
    ):
        for reader, writer in ((first, first_writer), (second, second_writer)):
            writer.write(GET_HEALTH)
            assert (await read_answer(reader))[0] == 200
        async with connected(server) as (third, third_writer):
            third_writer.write(post("/generate", {"input_ids": [1]}))
            assert (await read_answer(third))[0] == 200
            assert await asyncio.wait_for(first.read(), 10) == b"", "the idle longest closed"
            second_writer.write(GET_HEALTH)
            assert (await read_answer(second))[0] == 200
    assert (server.reclaimed, server.refused) == (1, 0)


async def test_at_the_connection_cap_with_none_idle_a_new_connection_gets_503() -> None:
    gateway = await make_gateway(Cluster())
    async with (
        serving(gateway, max_connections=1) as server,
        connected(server) as (busy, busy_writer),
    ):
        busy_writer.write(b"POST /generate HTTP/1.1\r\nhost: gw\r\n")
        await until(lambda: any(not c.idle for c in server.connections), "a request arriving")
        async with connected(server) as (refused, _):
            status, headers, body = await read_answer(refused)
        assert (status, headers["connection"]) == (503, "close")
        assert json.loads(body)["error"]["message"].startswith("too many client connections")
        busy_writer.write(b"content-length: 2\r\n\r\n{}")
        assert (await read_answer(busy))[0] == 400, "the connection served was kept"
    assert (server.reclaimed, server.refused) == (0, 1)
