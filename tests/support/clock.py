"""Time that tests move by hand: a clock that advances when told, a sleep that records."""

from __future__ import annotations


class FakeClock:
    """A `kvplumbing.clock.Clock` reading `now`, which only the test changes."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class RecordedSleep:
    """A `kvplumbing.clock.Sleep` that records each delay asked of it and returns at once."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
