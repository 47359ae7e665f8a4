"""The gateway's own upstream client (`PooledUpstream` on `ConnectionPool`) on real sockets."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable

import httpx
import pytest

from gateway.http.connection import DEAD_PEER_SECS
from gateway.http.connections import ConnectionPool
from gateway.http.reply import PAUSE_AT
from gateway.http.upstream import PooledUpstream
from gateway.requests.bodies import parse_request
from gateway.requests.query import RouteQuery
from gateway.settings.workers import WorkerSpec
from tests.gateway.fakes import Cluster, config, make_gateway, request_of, rest_of, sample
from tests.gateway.scripted import Handler, answer, keep_alive, read_request, running
from tests.support.net import await_for, free_port


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


async def test_fetch_gets_whole_answers_on_one_kept_connection() -> None:
    heads: list[bytes] = []
    echo = keep_alive(lambda _, body: answer(b"echo:" + body, b"content-type: x/y"), heads)
    async with running(echo) as server:
        pool = ConnectionPool()
        upstream = PooledUpstream(pool)
        for i in range(3):
            whole = await upstream.fetch(f"{server.url}/generate", b"%d" % i, 5.0)
            assert (whole.status, whole.body, whole.media_type) == (200, b"echo:%d" % i, b"x/y")
        await pool.aclose()
        host = server.url.split("//")[1].encode()
    assert server.connections == 1
    assert heads[0].startswith(b"POST /generate HTTP/1.1\r\nHost: " + host + b"\r\n")
    assert b"\r\nContent-Type: application/json\r\n" in heads[0]
    assert b"\r\nContent-Length: 1\r\n" in heads[0]


async def test_open_passes_pieces_as_they_arrive_then_reuses_the_connection() -> None:
    second = asyncio.Event()

    async def streaming(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(STREAM_HEAD + chunk(b"data: 1\n\n"))
            await writer.drain()
            await second.wait()
            writer.write(chunk(b"data: 2\n\n") + b"0\r\n\r\n")
            await writer.drain()

    async with running(streaming) as server:
        pool = ConnectionPool()
        upstream = PooledUpstream(pool)
        reply = await upstream.open(f"{server.url}/generate", b"{}", 5.0)
        assert (reply.status, reply.header(b"content-type")) == (200, b"text/event-stream")
        assert await reply.next() == b"data: 1\n\n"
        pending = asyncio.ensure_future(reply.next())
        assert not pending.done(), "piece 2 does not exist yet"
        second.set()
        assert await pending == b"data: 2\n\n"
        assert await reply.next() == b""
        await reply.aclose()
        again = await upstream.open(f"{server.url}/generate", b"{}", 5.0)
        assert await again.read() == b"data: 1\n\ndata: 2\n\n"
        await pool.aclose()
    assert server.connections == 1


async def test_a_cancelled_call_closes_its_connection_so_the_worker_sees_it() -> None:
    seen_close = asyncio.Event()

    async def hanging(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        assert await reader.read() == b""
        seen_close.set()

    async with running(hanging) as server:
        pool = ConnectionPool()
        call = asyncio.ensure_future(PooledUpstream(pool).fetch(f"{server.url}/x", b"{}", 5.0))
        await await_for(_async(lambda: server.connections == 1), timeout=5)
        call.cancel()
        await asyncio.wait_for(seen_close.wait(), 5)
        await pool.aclose()


async def test_a_stream_closed_early_closes_its_connection() -> None:
    seen_close = asyncio.Event()

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(STREAM_HEAD + chunk(b"a"))
        await writer.drain()
        assert await reader.read() == b""
        seen_close.set()

    async with running(endless) as server:
        pool = ConnectionPool()
        reply = await PooledUpstream(pool).open(f"{server.url}/x", b"{}", 5.0)
        assert await reply.next() == b"a"
        await reply.aclose()
        await asyncio.wait_for(seen_close.wait(), 5)
        await pool.aclose()


async def test_an_unread_stream_pauses_the_worker_and_resumes_as_it_is_read() -> None:
    piece = b"x" * 65536
    total = 40

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(STREAM_HEAD)
        for _ in range(total):
            writer.write(chunk(piece))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with running(flood) as server:
        pool = ConnectionPool()
        reply = await PooledUpstream(pool).open(f"{server.url}/x", b"{}", 5.0)
        connection = reply.connection
        assert connection is not None
        await await_for(_async(lambda: connection.paused), timeout=5, what="reading paused")
        assert reply._buffered <= PAUSE_AT + 2 * len(piece)
        body = await reply.read()
        assert body == piece * total
        await pool.aclose()


async def test_silence_raises_read_timeout_and_refusal_connect_error() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(STREAM_HEAD + chunk(b"a"))
        await writer.drain()
        await reader.read()

    async with running(silent) as server:
        pool = ConnectionPool()
        upstream = PooledUpstream(pool)
        with pytest.raises(httpx.ReadTimeout):
            await upstream.fetch(f"{server.url}/x", b"{}", 0.05)
        reply = await upstream.open(f"{server.url}/x", b"{}", 0.05)
        assert await reply.next() == b"a"
        with pytest.raises(httpx.ReadTimeout):
            await reply.next()
        await pool.aclose()
    with pytest.raises(httpx.ConnectError):
        await PooledUpstream(ConnectionPool()).fetch(f"http://127.0.0.1:{free_port()}/", b"", 5.0)


async def test_a_worker_that_drops_the_connection_mid_answer_is_an_error() -> None:
    async def dropping(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(STREAM_HEAD + chunk(b"a"))
        await writer.drain()

    async with running(dropping) as server:
        pool = ConnectionPool()
        reply = await PooledUpstream(pool).open(f"{server.url}/x", b"{}", 5.0)
        assert await reply.next() == b"a"
        with pytest.raises(httpx.RemoteProtocolError):
            await reply.next()
        with pytest.raises(httpx.RemoteProtocolError):
            await PooledUpstream(pool).fetch(f"{server.url}/x", b"{}", 5.0)
        await pool.aclose()


async def test_bad_urls_are_refused_before_any_connection() -> None:
    with pytest.raises(ValueError, match="http"):
        PooledUpstream(ConnectionPool()).fetch("ftp://x/y", b"", 1.0)


def _async(check: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def condition() -> bool:
        return check()

    return condition


async def test_dispatch_on_real_sockets_cancels_both_workers_when_forward_is_cancelled() -> None:
    received: list[str] = []
    closed: list[str] = []

    def hang(name: str) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            received.append(name)
            assert await reader.read() == b""
            closed.append(name)

        return handle

    async with running(hang("prefill")) as prefill, running(hang("decode")) as decode:
        pool = ConnectionPool()
        cfg = config(
            prefill=[WorkerSpec(url=prefill.url, role="prefill", bootstrap_port=8998)],
            decode=[WorkerSpec(url=decode.url, role="decode")],
        )
        gateway = await make_gateway(Cluster(), cfg, upstream=PooledUpstream(pool))
        parsed = parse_request("generate", {"input_ids": [1, 2, 3]})
        forward = asyncio.ensure_future(
            gateway.dispatcher.forward(request_of(parsed, RouteQuery([1, 2, 3])))
        )
        await await_for(_async(lambda: len(received) == 2), timeout=5, what="both calls")
        forward.cancel()
        with pytest.raises(asyncio.CancelledError):
            await forward
        await await_for(_async(lambda: len(closed) == 2), timeout=5, what="both closed")
        await gateway.calls.drain()
        await pool.aclose()
    assert all(w.breaker.stats().total_failures == 0 for w in gateway.pool)
    assert all(v.in_flight == 0 for v in gateway.loads.loads.values())


async def test_dispatch_on_real_sockets_retries_a_failed_prefill_and_streams_the_decode() -> None:
    good_prefill_called = asyncio.Event()

    async def prefill_ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            good_prefill_called.set()
            writer.write(answer(b"{}"))
            await writer.drain()

    async def prefill_failing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 503 Busy\r\ncontent-length: 4\r\n\r\nbusy")
            await writer.drain()

    async def decode(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            _, body = await read_request(reader)
            await good_prefill_called.wait()  # a decode waits for its prefill's KV
            room = json.loads(body)["bootstrap_room"]
            writer.write(STREAM_HEAD + chunk(b"data: %d\n\n" % room) + b"0\r\n\r\n")
            await writer.drain()

    async with (
        running(prefill_failing) as bad,
        running(prefill_ok) as good,
        running(decode) as dec,
    ):
        pool = ConnectionPool()
        cfg = config(
            prefill=[
                WorkerSpec(url=bad.url, role="prefill", bootstrap_port=8998),
                WorkerSpec(url=good.url, role="prefill", bootstrap_port=8999),
            ],
            decode=[WorkerSpec(url=dec.url, role="decode")],
            prefill_policy="round_robin",
        )
        gateway = await make_gateway(Cluster(), cfg, upstream=PooledUpstream(pool))
        parsed = parse_request("generate", {"input_ids": [1, 2], "stream": True})
        stream = await gateway.dispatcher.forward(request_of(parsed, RouteQuery([1, 2])))
        assert stream.rest is not None
        assert stream.media_type == b"text/event-stream"
        assert stream.body.startswith(b"data: ")
        assert await rest_of(stream) == b""
        await stream.rest.close("done")
        await gateway.calls.drain()
        await pool.aclose()
    bad_worker = gateway.pool.get(bad.url.split("//")[1])
    assert bad_worker is not None
    assert bad_worker.breaker.stats().total_failures == 1
    assert (
        sample(gateway, "globalkv_gateway_retries_total", endpoint="generate", role="prefill") == 1
    )


async def test_a_connection_paused_for_its_last_answer_reads_the_next_one() -> None:
    """The piece that crosses PAUSE_AT also ends the answer: the connection goes back to
    the pool paused and must read the next answer. The server sends that last piece only
    once the rest is buffered, so it arrives in one read whatever the kernel's chunking."""
    first, last = b"y" * (PAUSE_AT - 500), b"z" * 1000
    buffered = asyncio.Event()
    calls = 0

    async def large(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal calls
        while True:
            await read_request(reader)
            calls += 1
            writer.write(STREAM_HEAD + chunk(first))
            await writer.drain()
            if calls == 1:
                await buffered.wait()
            writer.write(chunk(last) + b"0\r\n\r\n")
            await writer.drain()

    async with running(large) as server:
        pool = ConnectionPool()
        upstream = PooledUpstream(pool)
        reply = await upstream.open(f"{server.url}/x", b"{}", 5.0)
        await await_for(_async(lambda: reply._buffered >= len(first)), timeout=5, what="1st")
        buffered.set()
        await await_for(_async(lambda: reply.done), timeout=5, what="the whole answer")
        (connection,) = pool._idle[("http", "127.0.0.1", int(server.url.rsplit(":", 1)[1]))]
        assert not connection.paused, "resumed when given back to the pool"
        assert await reply.read() == first + last
        again = await asyncio.wait_for(upstream.fetch(f"{server.url}/x", b"{}", 5.0), 10)
        assert again.body == first + last
        await pool.aclose()
    assert server.connections == 1


@pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="TCP_USER_TIMEOUT is Linux's")
async def test_a_worker_connection_gives_up_on_a_peer_that_acknowledges_nothing() -> None:
    """A killed container sends no reset; the kernel must fail the connection within
    DEAD_PEER_SECS instead of the request waiting out its whole timeout."""
    echo = keep_alive(lambda _, body: answer(body, b"content-type: x/y"), [])
    async with running(echo) as server:
        pool = ConnectionPool()
        await PooledUpstream(pool).fetch(f"{server.url}/generate", b"x", 5.0)
        ((connection,),) = pool._idle.values()
        sock = connection._transport.get_extra_info("socket")
        user_timeout = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)
        await pool.aclose()
    assert user_timeout == round(DEAD_PEER_SECS * 1000)
