"""Stopping tasks that lose their cancellation, as one awaiting `asyncio.wait_for` can on
Python 3.11 (redis-py sends every command through it): `cancel_and_wait` still ends them.

The loss is reproduced exactly: the call `wait_for` waits for completes in the same loop
iteration as the cancellation lands (on 3.12 and later the cancellation is kept and the
same tests pass without a second cancellation).
"""

from __future__ import annotations

import asyncio

from globalkv.index.base import IndexUnavailable
from globalkv.index.memory import MemoryIndex
from globalkv.indexer import Indexer, IndexerConfig
from globalkv.registry import MemoryRegistry
from kvplumbing.tasks import cancel_and_wait


class _Call:
    """A call under `asyncio.wait_for` that the test completes when it wants."""

    def __init__(self) -> None:
        self.waiting = asyncio.Event()
        self.result: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

    async def __call__(self) -> bool:
        self.waiting.set()
        return await asyncio.wait_for(self.result, 5)

    def complete_as_cancelled(self, task: asyncio.Task[None]) -> None:
        self.result.set_result(True)
        task.cancel()


async def test_a_loop_that_lost_its_cancellation_is_cancelled_again_and_ends() -> None:
    call = _Call()
    rounds = 0

    async def loop() -> None:
        nonlocal rounds
        while True:
            rounds += 1
            if rounds == 1:
                await call()
            await asyncio.sleep(0.01)

    task = asyncio.create_task(loop())
    await call.waiting.wait()
    call.complete_as_cancelled(task)
    async with asyncio.timeout(10):
        await cancel_and_wait([task], again_after=0.05)
    assert task.cancelled()


async def test_tasks_that_ended_by_themselves_are_waited_for_without_raising() -> None:
    async def fails() -> None:
        raise RuntimeError("gone")

    ended, failed = asyncio.create_task(asyncio.sleep(0)), asyncio.create_task(fails())
    await asyncio.wait([ended, failed])
    async with asyncio.timeout(10):
        await cancel_and_wait([ended, failed])
    assert ended.result() is None
    assert isinstance(failed.exception(), RuntimeError)


class _SwallowingRegistry(MemoryRegistry):
    """Its `intact()` awaits a call that completes just as the caller is cancelled."""

    def __init__(self, call: _Call) -> None:
        super().__init__()
        self.call = call

    async def intact(self) -> bool:
        if self.call.result.done():
            raise IndexUnavailable("redis is restarting")
        return await self.call()


async def test_the_indexer_stops_although_a_registry_call_swallowed_its_cancellation() -> None:
    """What hung `Indexer.stop()` after a Redis restart: the pod-registry loop, its
    cancellation lost inside redis-py, kept reconciling, and the stop waited for it."""
    call = _Call()
    config = IndexerConfig(block_size=4, reconcile_interval=0.01)
    indexer = Indexer(config, index=MemoryIndex(4), registry=_SwallowingRegistry(call))
    await indexer.start()
    await call.waiting.wait()
    call.result.set_result(True)  # the stop's cancellation lands as this completes
    async with asyncio.timeout(10):
        await indexer.stop()
