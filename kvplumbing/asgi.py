"""What an ASGI service enforces around each request: a bounded body, a client still there.

A body is read whole before a framework parses it, so its size is checked first, by
Content-Length when announced and by counting as it streams otherwise (Content-Length
can lie): a limit met inside FastAPI's own parsing would surface as a generic 400.

A request can wait long on its peers (a prefill for the decode's handshake, a gateway for
both halves of a PD pair) and FastAPI does not cancel a handler whose client went away.
Once the body is read, the only message an ASGI server can still deliver is
`http.disconnect`, so a watcher on `receive` learns of it at once and the work is
cancelled; cancellation then runs the work's own clean-up.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

T = TypeVar("T")

CLIENT_GONE_STATUS = 499
"""nginx's "client closed request": never seen by the client, it marks the answer in logs."""


class ClientGone(Exception):
    """The client disconnected before its answer was ready (its work, if any, cancelled)."""


class BodyTooLarge(Exception):
    """The request body is, or is announced to be, over `limit` bytes."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body larger than {limit} bytes")
        self.limit = limit


def _announced_over(scope: Scope, limit: int) -> bool:
    return any(
        name == b"content-length" and value.isdigit() and int(value) > limit
        for name, value in scope.get("headers", [])
    )


async def receive_body(scope: Scope, receive: Receive, limit: int) -> list[Message]:
    """The request's messages up to its last body part, or up to the client leaving.

    Raises `BodyTooLarge` as soon as more than `limit` bytes are announced or have
    arrived, before the rest is read.
    """
    if _announced_over(scope, limit):
        raise BodyTooLarge(limit)
    messages: list[Message] = []
    size = 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return messages
        size += len(message.get("body", b""))
        if size > limit:
            raise BodyTooLarge(limit)
        if not message.get("more_body", False):
            return messages


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole request body; `BodyTooLarge` past `limit`, `ClientGone` if it left first."""
    messages = await receive_body(scope, receive, limit)
    if messages[-1]["type"] != "http.request":
        raise ClientGone
    return b"".join(m.get("body", b"") for m in messages)


class BodyLimit:
    """ASGI middleware: a body over `limit` bytes is answered by `refuse(path)`, unread.

    A body within the limit is read here and handed on whole, so the app's own parsing
    never meets an oversized one.
    """

    def __init__(self, app: ASGIApp, *, limit: int, refuse: Callable[[str], ASGIApp]) -> None:
        self.app = app
        self.limit = limit
        self.refuse = refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            read = await receive_body(scope, receive, self.limit)
        except BodyTooLarge:
            await self.refuse(scope["path"])(scope, receive, send)
            return

        async def replay() -> Message:
            return read.pop(0) if read else await receive()

        await self.app(scope, replay, send)


async def until_disconnected(receive: Receive) -> None:
    """Return when the client disconnects; every other message is passed over."""
    while (await receive())["type"] != "http.disconnect":
        continue


async def unless_client_leaves(
    receive: Receive,
    work: Awaitable[T],
    *,
    abandon: Callable[[T], Awaitable[None]] | None = None,
) -> T:
    """`work`'s result; or, as soon as the client disconnects, `work` cancelled and
    `ClientGone` raised. Call only after the request body has been read.

    Work that still finishes with a result after its cancellation (it was already done
    but for one step) is handed to `abandon`, so what it holds (an upstream stream) is
    released rather than leaked.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnected(receive))
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
    (outcome,) = await asyncio.gather(task, return_exceptions=True)
    if isinstance(outcome, Exception):
        log.warning("work failed after its client left: %r", outcome)
    elif not isinstance(outcome, BaseException) and abandon is not None:
        await abandon(outcome)
    watcher.result()
    raise ClientGone
