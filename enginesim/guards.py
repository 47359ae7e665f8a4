"""What the engine's HTTP layer enforces around each request: the client is still there.

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
from collections.abc import Awaitable
from typing import TypeVar

from starlette.types import Receive

T = TypeVar("T")

CLIENT_GONE_STATUS = 499
"""nginx's "client closed request": never seen by the client, it marks the answer in logs."""


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
