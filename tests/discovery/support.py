"""Waiting on a discovery source, and recording what a consumer would apply."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from globalkv.discovery.model import Changes, Snapshot, follow


async def until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Yield to the loop until `condition` holds, or fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(0.01)


@asynccontextmanager
async def consumer(snapshots: AsyncIterator[Snapshot]) -> AsyncIterator[list[Changes]]:
    """`follow` the snapshots in the background; the list of changes it applied."""
    applied: list[Changes] = []

    async def apply(step: Changes) -> None:
        applied.append(step)

    task = asyncio.create_task(follow(snapshots, apply))
    try:
        yield applied
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def removed_ids(applied: list[Changes]) -> list[str]:
    return [worker.id for step in applied for worker in step.removed]


def added_ids(applied: list[Changes]) -> list[str]:
    return [worker.id for step in applied for worker in step.added]


def applied_ids(applied: list[Changes]) -> set[str]:
    """The workers a consumer holds after applying every change it received so far."""
    held: set[str] = set()
    for step in applied:
        held -= {worker.id for worker in step.removed}
        held |= {worker.id for worker in step.added}
    return held
