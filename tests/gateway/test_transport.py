"""The gateway's pooled transport against a scripted raw-socket server on 127.0.0.1."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from gateway.transport import PooledTransport, upstream_client

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, await reader.readexactly(length)


def answer(body: bytes, *extra: bytes) -> bytes:
    headers = b"".join(h + b"\r\n" for h in extra)
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), headers, body)


class Server:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []
        self.server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"


async def serving(handler: Handler) -> AsyncIterator[tuple[Server, httpx.AsyncClient]]:
    server = Server(handler)
    server.server = await asyncio.start_server(server._serve, "127.0.0.1", 0)
    async with httpx.AsyncClient(transport=PooledTransport()) as client:
        yield server, client
    server.server.close()
    await server.server.wait_closed()


def keep_alive(make: Callable[[bytes, bytes], bytes], heads: list[bytes] | None = None) -> Handler:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, body = await read_request(reader)
            if heads is not None:
                heads.append(head)
            writer.write(make(head, body))
            await writer.drain()

    return handle


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
