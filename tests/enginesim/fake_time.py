"""A clock for driving the prefill scheduler without waiting."""

from __future__ import annotations

import asyncio


class FakeTime:
    """A clock that only moves when the code under test sleeps; `hold` pauses every step."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []
        self.hold = asyncio.Event()
        self.hold.set()
        self.stepping = asyncio.Event()

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.stepping.set()
        await self.hold.wait()
        self.now += seconds
        await asyncio.sleep(0)
