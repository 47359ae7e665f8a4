"""The tasks ingest starts and nobody awaits until shutdown, their failures logged at once.

A subscription or worker that died silently would leave its pod invisible for good, so
each task logs its own failure when it happens; `Background` keeps the one-off tasks
(registry writes, stopping a fenced pod) so that stopping ingest cancels them too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from kvplumbing.tasks import cancel_and_wait

log = logging.getLogger(__name__)


def watched(coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
    """A task whose failure is logged when it happens."""
    task = asyncio.create_task(coro, name=name)
    task.add_done_callback(_log_failure)
    return task


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("%s stopped: %r", task.get_name(), exc, exc_info=exc)


class Background:
    """One-off tasks, each forgotten when it ends, all cancelled by `stop`."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = watched(coro, name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def stop(self) -> None:
        await cancel_and_wait(list(self._tasks))
