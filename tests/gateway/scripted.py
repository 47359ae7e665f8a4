"""A scripted raw-socket HTTP server on 127.0.0.1 for the client tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

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
        self.handlers: set[asyncio.Task[None]] = set()
        self.server: asyncio.Server | None = None
        self.url = ""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        try:
            await self.handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except asyncio.CancelledError:
            return  # the test is over (a cancelled handler would be logged as an error)
        finally:
            self.handlers.discard(task)
            writer.close()

    async def stop(self) -> None:
        """Stop listening and end the handlers still running."""
        assert self.server is not None
        self.server.close()
        for task in list(self.handlers):
            task.cancel()
        await asyncio.gather(*self.handlers)
        await self.server.wait_closed()


@asynccontextmanager
async def running(handler: Handler) -> AsyncIterator[Server]:
    server = Server(handler)
    server.server = await asyncio.start_server(server._serve, "127.0.0.1", 0)
    server.url = f"http://127.0.0.1:{server.server.sockets[0].getsockname()[1]}"
    try:
        yield server
    finally:
        await server.stop()


def keep_alive(make: Callable[[bytes, bytes], bytes], heads: list[bytes] | None = None) -> Handler:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, body = await read_request(reader)
            if heads is not None:
                heads.append(head)
            writer.write(make(head, body))
            await writer.drain()

    return handle
