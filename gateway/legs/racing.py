"""Racing an attempt's two calls: futures watched through done-callbacks, not tasks.

With the connection pool an upstream call is a future its connection resolves, so
waiting for "this step, unless the prefill fails first" costs a callback on each future
rather than a task per wait.
"""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.http.reply import Reply

Call = asyncio.Future[Reply]
"""The prefill's call."""


def answered_call(loop: asyncio.AbstractEventLoop) -> Call:
    """A prefill call that succeeded, for a decode sent without one: it computes the prompt
    itself (`--vllm-allow-recompute`, or a local prefill)."""
    reply = Reply(loop, b"", None, whole=True)
    reply.on_head(200, [])
    reply.on_piece(b"{}")
    reply.on_end()
    call: Call = loop.create_future()
    call.set_result(reply)
    return call


def failed(call: Call) -> bool:
    """Ended without a successful answer (transport error or status >= 400)."""
    if not call.done() or call.cancelled():
        return False
    return call.exception() is not None or call.result().status >= 400


async def _first(*futures: asyncio.Future[Any]) -> None:
    """Until one of `futures` is done, without raising what it raised."""
    # Their loop, not asyncio.get_running_loop(): that one makes a getpid() system call.
    waiter: asyncio.Future[None] = futures[0].get_loop().create_future()

    def wake(_: asyncio.Future[Any]) -> None:
        if not waiter.done():
            waiter.set_result(None)

    for future in futures:
        future.add_done_callback(wake)
    try:
        await waiter
    finally:
        for future in futures:
            future.remove_done_callback(wake)


async def race(step: asyncio.Future[Any], call: Call) -> bool:
    """Wait for `step` unless the prefill fails first; True when `step` finished."""
    if not step.done() and not call.done():
        await _first(step, call)
    if step.done():
        return True
    if failed(call):
        return False
    await _first(step)
    return True


async def settle(*futures: asyncio.Future[Any]) -> None:
    """Until cancelled calls have finished cancelling (httpx's run as tasks)."""
    pending = [f for f in futures if not f.done()]
    if pending:
        await asyncio.wait(pending)
