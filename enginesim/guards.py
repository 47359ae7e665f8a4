"""What the engine's HTTP layer enforces around each request: a bounded body, and a
client that is still there.

A body is read whole before FastAPI parses it into a model, so its size is checked first,
by Content-Length when announced and by counting as it streams otherwise: a limit met
inside FastAPI's own parsing would surface as a generic 400.

A prompt can wait long on its peer (a prefill for the decode's handshake, a decode for
the KV) and a whole answer can take minutes to generate. FastAPI does not cancel a
handler whose client went away, so a router that dropped a request (its client left, or
it cancelled the prefill call) would leave the engine waiting for nothing. Once the body
is read, the only message the server can still deliver is `http.disconnect`, so a
watcher on `receive` learns of it at once and the work is cancelled; cancellation then
runs each engine's own clean-up (a prefill tells the decode the room failed).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

T = TypeVar("T")

CLIENT_GONE_STATUS = 499
"""nginx's "client closed request": never seen by the client, it marks the answer in logs."""


class BodyLimit:
    """ASGI middleware: bodies over `limit` bytes get `refuse(path)` (a 413) unread."""

    def __init__(self, app: ASGIApp, *, limit: int, refuse: Callable[[str], Response]) -> None:
        self.app = app
        self.limit = limit
        self.refuse = refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            await self.refuse(scope["path"])(scope, receive, send)
            return
        read: list[Message] = []
        size = 0
        while not read or read[-1].get("more_body", False):
            message = await receive()
            read.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.limit:
                await self.refuse(scope["path"])(scope, receive, send)
                return

        async def replay() -> Message:
            return read.pop(0) if read else await receive()

        await self.app(scope, replay, send)


class ClientGone(Exception):
    """The client disconnected before its answer was ready; its work was cancelled."""


async def _until_disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        continue


async def unless_client_leaves(receive: Receive, work: Awaitable[T]) -> T:
    """`work`'s result; or, as soon as the client disconnects, `work` cancelled and
    `ClientGone` raised. Call only after the request body has been read."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(receive))
    try:
        done, _ = await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
        raise
    if task in done:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    watcher.result()
    raise ClientGone
