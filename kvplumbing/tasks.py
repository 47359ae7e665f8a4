"""Stopping background tasks for good, even when one of them loses its cancellation.

Python 3.11's `asyncio.wait_for` drops a cancellation that lands while the call it waits
for has just completed: it returns that call's result instead (CPython gh-86296, fixed in
3.12, where `wait_for` is built on `asyncio.timeout`). redis-py sends every command
through `asyncio.wait_for` while its socket timeout is set, which it is by default (5 s).
A loop whose cancellation was dropped there carries on: the indexer's pod-registry loop,
cancelled once by `Indexer.stop()`, kept reconciling and the stop waited for it forever.

`cancel_and_wait` cancels again, every `again_after` seconds, each task that has not ended.
The first cancellation gets that long to finish its clean-up undisturbed. Our own timed
waits use `asyncio.timeout`, which keeps every cancellation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

AGAIN_AFTER_SECS = 1.0


async def cancel_and_wait(
    tasks: Iterable[asyncio.Future[Any]], *, again_after: float = AGAIN_AFTER_SECS
) -> None:
    """Cancel `tasks` and return once every one has ended; what they raised is retrieved
    (and dropped: a stopping component has no one to give it to)."""
    every = list(tasks)
    pending = {task for task in every if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=again_after)
    await asyncio.gather(*every, return_exceptions=True)
