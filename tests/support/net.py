"""Free ports and bounded waits: on a live process, or on work queued on this event loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import httpx

from kvplumbing.ports import unclaimed_ports


def free_port() -> int:
    """A port free on 127.0.0.1 now, outside the range the kernel picks ports from."""
    return unclaimed_ports(1)[0]


def wait_for(condition: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    """Poll a condition on a live process until it holds or the deadline passes."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.02)


async def await_for(
    condition: Callable[[], Awaitable[bool]], timeout: float = 20.0, what: str = "condition"
) -> None:
    deadline = time.monotonic() + timeout
    while not await condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(0.02)


async def until(condition: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    """Yield to this event loop until `condition` holds: work it has queued (a request
    reaching a queue, a task ending), not a live process (`wait_for`, `await_for`). Fails
    naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(0)


def http_ok(url: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            return httpx.get(url, timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    return check
