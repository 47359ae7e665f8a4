"""HostResolver: one lookup per name in flight, answers kept for the ttl, addresses as is."""

from __future__ import annotations

import asyncio

import pytest

from gateway.http.resolver import HostResolver
from tests.support.clock import FakeClock


class Lookups:
    """A resolver's lookups, each answered when the test says so."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.waiting: list[asyncio.Future[str]] = []

    async def __call__(self, host: str, port: int) -> str:
        self.calls.append((host, port))
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.waiting.append(future)
        return await future


async def _started(lookups: Lookups, count: int) -> None:
    """Let the resolver's tasks run until `count` lookups have begun (a few loop turns)."""
    for _ in range(100):
        if len(lookups.waiting) >= count:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{len(lookups.waiting)} lookups began, expected {count}")


async def test_concurrent_lookups_of_a_name_share_one() -> None:
    lookups = Lookups()
    resolver = HostResolver(lookup=lookups)
    calls = [asyncio.ensure_future(resolver.resolve("prefill-0", 80)) for _ in range(5)]
    await _started(lookups, 1)
    lookups.waiting[0].set_result("10.0.0.5")
    assert await asyncio.gather(*calls) == ["10.0.0.5"] * 5
    assert lookups.calls == [("prefill-0", 80)]


async def test_a_hung_name_holds_one_lookup_and_others_still_resolve() -> None:
    lookups = Lookups()
    resolver = HostResolver(lookup=lookups)
    for _ in range(3):
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(resolver.resolve("dead", 80), 0.01)
    assert lookups.calls == [("dead", 80)], "waiters that gave up did not start new lookups"
    live = asyncio.ensure_future(resolver.resolve("alive", 80))
    await _started(lookups, 2)
    lookups.waiting[1].set_result("10.0.0.6")
    assert await live == "10.0.0.6"
    lookups.waiting[0].set_exception(OSError("Temporary failure in name resolution"))
    with pytest.raises(OSError, match="Temporary failure"):
        await resolver.resolve("dead", 80)
    assert len(lookups.calls) == 2, "the failure is kept, not looked up again at once"


async def test_answers_expire_after_the_ttl_and_forget_drops_one() -> None:
    lookups = Lookups()
    clock = FakeClock(100.0)
    resolver = HostResolver(ttl=5.0, clock=clock, lookup=lookups)
    first = asyncio.ensure_future(resolver.resolve("w", 80))
    await _started(lookups, 1)
    lookups.waiting[0].set_result("10.0.0.1")
    assert await first == "10.0.0.1"
    clock.now += 4.9
    assert await resolver.resolve("w", 80) == "10.0.0.1"
    clock.now += 0.2
    again = asyncio.ensure_future(resolver.resolve("w", 80))
    await _started(lookups, 2)
    lookups.waiting[1].set_result("10.0.0.2")
    assert await again == "10.0.0.2"
    resolver.forget("w", 80)
    moved = asyncio.ensure_future(resolver.resolve("w", 80))
    await _started(lookups, 3)
    lookups.waiting[2].set_result("10.0.0.3")
    assert await moved == "10.0.0.3"


async def test_addresses_need_no_lookup() -> None:
    lookups = Lookups()
    resolver = HostResolver(lookup=lookups)
    assert await resolver.resolve("127.0.0.1", 80) == "127.0.0.1"
    assert await resolver.resolve("::1", 80) == "::1"
    assert lookups.calls == []


async def test_the_default_lookup_resolves_localhost() -> None:
    assert await HostResolver().resolve("localhost", 80) in {"127.0.0.1", "::1"}
