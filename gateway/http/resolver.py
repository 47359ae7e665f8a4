"""Worker host names to addresses: one lookup in flight per name, each answer kept briefly.

asyncio resolves a name in its default thread pool (a handful of threads on a small
machine) and cannot cancel a lookup once it runs. When one worker's name stops resolving
promptly (its container went away on a network whose DNS forwards the name to a server
that does not answer), every new connection to it would take a thread for the whole
lookup; a few of those and the lookups of every other worker wait behind them, so one
dead worker stalls the gateway. Here concurrent lookups of a name share one, which runs
to its end on its own, whoever stopped waiting for it; its answer, address or failure,
serves the calls of the next `ttl` seconds. A name of a live worker re-resolves at most
that often, so a worker that moved is found again.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections.abc import Awaitable, Callable

from kvplumbing.clock import Clock

Lookup = Callable[[str, int], Awaitable[str]]
_KEPT = 4096
"""Names kept before the expired ones are swept (a gateway has a few dozen workers)."""


def is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def getaddr(host: str, port: int) -> str:
    """The first stream address of `host`, by the loop's resolver."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    if not infos:
        raise OSError(f"{host} has no address")
    return str(infos[0][4][0])


class HostResolver:
    """`await resolve(host, port)` → an address to connect to; `OSError` if it has none."""

    def __init__(
        self, *, ttl: float = 5.0, clock: Clock = time.monotonic, lookup: Lookup | None = None
    ) -> None:
        self._ttl = ttl
        self._clock = clock
        self._lookup = lookup or getaddr
        self._known: dict[tuple[str, int], tuple[float, str | None, str]] = {}
        """(host, port) → (until when, the address or None, why there is none)."""
        self._pending: dict[tuple[str, int], asyncio.Future[str]] = {}

    async def resolve(self, host: str, port: int) -> str:
        if is_address(host):
            return host
        key = (host, port)
        known = self._known.get(key)
        if known is not None and known[0] > self._clock():
            if known[1] is None:
                raise OSError(known[2])
            return known[1]
        lookup = self._pending.get(key)
        if lookup is None:
            lookup = asyncio.ensure_future(self._lookup(host, port))
            self._pending[key] = lookup
            lookup.add_done_callback(lambda done: self._settled(key, done))
        return await asyncio.shield(lookup)

    def forget(self, host: str, port: int) -> None:
        """Drop a kept answer (a connection to it failed: the worker may have moved)."""
        self._known.pop((host, port), None)

    def _settled(self, key: tuple[str, int], lookup: asyncio.Future[str]) -> None:
        self._pending.pop(key, None)
        if lookup.cancelled():
            return
        error = lookup.exception()
        until = self._clock() + self._ttl
        if error is None:
            self._known[key] = (until, lookup.result(), "")
        else:
            self._known[key] = (until, None, f"{key[0]}: {error}")
        if len(self._known) > _KEPT:
            now = self._clock()
            self._known = {k: v for k, v in self._known.items() if v[0] > now}
