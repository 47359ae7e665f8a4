"""httpx's interface over the gateway's connection pool, against a scripted raw-socket server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from gateway.http.transport import PooledTransport, upstream_client
from tests.gateway.scripted import Handler, Server, answer, keep_alive, read_request, running


async def serving(handler: Handler) -> AsyncIterator[tuple[Server, httpx.AsyncClient]]:
    async with running(handler) as server, httpx.AsyncClient(transport=PooledTransport()) as client:
        yield server, client


async def test_requests_reuse_one_connection_and_carry_body_and_headers() -> None:
    heads: list[bytes] = []
    async for server, client in serving(keep_alive(lambda h, b: answer(b"echo:" + b), heads)):
        for i in range(5):
            response = await client.post(
                f"{server.url}/generate?x=1", content=b"%d" % i, headers={"x-id": "7"}
            )
            assert (response.status_code, response.content) == (200, b"echo:%d" % i)
        assert server.connections == 1
        assert heads[0].startswith(b"POST /generate?x=1 HTTP/1.1\r\n")
        assert b"\r\nx-id: 7\r\n" in heads[0]
        assert b"\r\nContent-Length: 1\r\n" in heads[0]


async def test_concurrent_requests_open_connections_then_reuse_them() -> None:
    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            await asyncio.sleep(0)
            writer.write(answer(b"ok"))
            await writer.drain()

    async for server, client in serving(slow):
        for _ in range(3):
            answers = await asyncio.gather(*(client.get(server.url) for _ in range(8)))
            assert all(a.content == b"ok" for a in answers)
        assert server.connections == 8


async def test_chunked_stream_arrives_chunk_by_chunk_and_the_connection_is_reused() -> None:
    release = asyncio.Event()

    async def chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
            await writer.drain()
            await release.wait()
            writer.write(b"6;ext=1\r\nsecond\r\n0\r\n\r\n")
            await writer.drain()

    async for server, client in serving(chunked):
        async with client.stream("POST", server.url, content=b"{}") as response:
            chunks = response.aiter_raw()
            assert await chunks.__anext__() == b"first"
            release.set()
            assert [c async for c in chunks] == [b"second"]
        again = await client.post(server.url, content=b"{}")
        assert again.content == b"firstsecond"
        assert server.connections == 1


async def test_a_stream_closed_early_closes_its_connection() -> None:
    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n")
        await writer.drain()
        await reader.read()  # until the client hangs up

    async for server, client in serving(endless):
        async with client.stream("GET", server.url) as response:
            assert await response.aiter_raw().__anext__() == b"a"
        assert server.connections == 1
        async with client.stream("GET", server.url) as response:
            assert await response.aiter_raw().__anext__() == b"a"
        assert server.connections == 2


async def test_close_delimited_and_connection_close_answers_are_not_reused() -> None:
    async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await read_request(reader)
        if b"/close" in head.split(b"\r\n")[0]:
            writer.write(answer(b"bye", b"connection: close"))
        else:
            writer.write(b"HTTP/1.1 200 OK\r\n\r\nuntil the end")
        await writer.drain()

    async for server, client in serving(once):
        assert (await client.get(f"{server.url}/eof")).content == b"until the end"
        assert (await client.get(f"{server.url}/close")).content == b"bye"
        assert (await client.get(f"{server.url}/eof")).content == b"until the end"
        assert server.connections == 3


async def test_an_idle_connection_the_peer_closed_is_replaced() -> None:
    async def one_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer(b"ok"))  # keep-alive promised, then closed while idle
        await writer.drain()

    async for server, client in serving(one_answer):
        for _ in range(3):
            assert (await client.post(server.url, content=b"x")).content == b"ok"
        assert server.connections == 3


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort", httpx.RemoteProtocolError),
        (b"garbage\r\n\r\n", httpx.RemoteProtocolError),
        (b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n", httpx.RemoteProtocolError),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", httpx.RemoteProtocolError),
        (b"", httpx.RemoteProtocolError),
    ],
)
async def test_broken_answers_are_httpx_errors(reply: bytes, error: type[Exception]) -> None:
    async def broken(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(reply)
        await writer.drain()

    async for server, client in serving(broken):
        with pytest.raises(error):
            await client.post(server.url, content=b"x")


async def test_refused_and_silent_peers_raise_connect_and_read_errors() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    async for server, client in serving(silent):
        with pytest.raises(httpx.ReadTimeout):
            await client.post(server.url, content=b"x", timeout=0.05)
        url = server.url
    async with httpx.AsyncClient(transport=PooledTransport()) as client:
        with pytest.raises(httpx.ConnectError):
            await client.get(url)


async def test_the_upstream_client_keeps_no_cookie_between_requests() -> None:
    heads: list[bytes] = []
    setter = keep_alive(lambda h, b: answer(b"ok", b"set-cookie: session=abc; Path=/"), heads)
    async for server, _ in serving(setter):
        async with upstream_client() as client:
            for _ in range(2):
                assert (await client.get(server.url)).headers["set-cookie"].startswith("session")
            assert not client.cookies
        assert all(b"cookie:" not in head.lower() for head in heads)
