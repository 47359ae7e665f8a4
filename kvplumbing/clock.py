"""The shapes of time that components take as arguments, so tests can drive them.

A component reads `Clock` (`time.monotonic` in production), `WallClock` (`time.time`)
where a timestamp leaves the process, and awaits `Sleep`
(`asyncio.sleep`) instead of calling them directly; a test passes a fake clock it moves
by hand and a sleep that records the delays instead of waiting.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

Clock = Callable[[], float]
"""Seconds on a clock that never goes back (`time.monotonic`)."""

WallClock = Callable[[], float]
"""Seconds since the epoch (`time.time`): for timestamps shown to people or other hosts."""

Sleep = Callable[[float], Awaitable[object]]
"""Wait this many seconds (`asyncio.sleep`)."""
