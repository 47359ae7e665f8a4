"""The gateway's HTTP/1.1 server: its handler's POSTs on asyncio protocols, the rest by an app.

Why its own server rather than uvicorn or granian: it spends less CPU per answered
request, streamed or not (`docs/gateway-design.md` has the measurements and their
commands). Each connection is a `gateway.http.client_connection` protocol, which parses
requests with httptools in `data_received` and answers each in order with a
`gateway.http.exchange.Exchange`: the handler's paths through the `Handler` (one task per
request, the answer written as prebuilt bytes), every other request to the ASGI app, so
those routes keep their one implementation. Here: listening, timeouts for clients that
make a connection wait (idle keep-alive connections closed after `keep_alive_secs`; a
request whose head takes longer than `read_timeout_secs` to arrive, or whose body stalls
that long, answered 408 and closed — a few slow clients must not hold connections
forever), a cap on client connections, and a graceful `shutdown` (stop accepting, finish
what is in flight, then close).

Request bodies are bounded one by one (the handler's `limit`, 413) and all together
(`budget`, a `kvplumbing.budget.BodyBudget`, 503): unfinished large bodies on many
connections once grew the process by their sum.

The cap (`max_connections`; by default half the process's open-files limit,
`default_max_connections`) keeps the other half for the connections to the workers: idle
client connections that took every file descriptor made each call to a worker fail
(EMFILE), and the worker was blamed. At the cap, a new connection first takes the place of
the connection idle longest between requests (closed, as its keep-alive timeout would);
with none idle it is answered 503 and closed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
from collections.abc import Mapping

from starlette.types import ASGIApp

from gateway.http.answer import problem
from gateway.http.client_connection import ClientConnection
from gateway.http.client_wire import ConnectionState
from gateway.http.exchange import Handler
from gateway.http.wire import CLOSE, answer_bytes
from kvplumbing.budget import BodyBudget, default_total

log = logging.getLogger(__name__)
_FULL_LOG_EVERY_SECS = 60.0


def default_max_connections() -> int:
    """Half the soft open-files limit (at least 16): the rest is for the connections to
    the workers, the index, logs and the process's own files."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    return max(16, soft // 2)


_FULL = problem(503, "too many client connections; try again later", "overloaded")


class HttpServer:
    """Listens, serves each connection with a `ClientConnection`, and stops gracefully."""

    def __init__(
        self,
        handler: Handler,
        app: ASGIApp,
        *,
        keep_alive_secs: float = 5.0,
        read_timeout_secs: float = 30.0,
        max_connections: int | None = None,
        budget: BodyBudget | None = None,
    ):
        self.handler = handler
        self.app = app
        self.routes: Mapping[bytes, str] = {path.encode(): path for path in handler.paths}
        self.limit = handler.limit
        self.budget = budget or BodyBudget(default_total(handler.limit))
        self.short_of_room = 0
        """Bodies refused for want of room in the budget, since the start."""
        self._short_logged_at = -_FULL_LOG_EVERY_SECS
        self.connections: set[ClientConnection] = set()
        self.max_connections = max_connections or default_max_connections()
        self.reclaimed = 0
        """Idle connections closed to make room for a new one, since the start."""
        self.refused = 0
        """Connections refused at the cap with none idle, since the start."""
        self._full_logged_at = -_FULL_LOG_EVERY_SECS
        self._keep_alive = keep_alive_secs
        self._read_timeout = read_timeout_secs
        self._sweep_every = max(min(keep_alive_secs, read_timeout_secs) / 2, 0.05)
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        self._emptied: asyncio.Future[None] | None = None

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: ClientConnection(self), host, port, backlog=2048, reuse_address=True
        )
        self._sweeper = loop.call_later(self._sweep_every, self._sweep)

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    def admit(self, connection: ClientConnection) -> None:
        """Take `connection` in, making room at the cap by closing the connection idle
        longest; with none idle, `connection` is answered 503 and closed."""
        if len(self.connections) >= self.max_connections:
            idle = [c for c in self.connections if c.idle and c.state is ConnectionState.OPEN]
            if not idle:
                self.refused += 1
                self._full(f"a new one refused ({self.refused} since the start)")
                connection.write(answer_bytes(_FULL, CLOSE))
                connection.close()
                return
            oldest = min(idle, key=lambda c: c.last_active)
            self.connections.discard(oldest)
            oldest.close()
            self.reclaimed += 1
            self._full(f"the connection idle longest closed ({self.reclaimed} since the start)")
        self.connections.add(connection)

    def _full(self, what: str) -> None:
        """Logged at most once a minute: a flood of connections must not flood the log."""
        now = asyncio.get_running_loop().time()
        if now - self._full_logged_at >= _FULL_LOG_EVERY_SECS:
            self._full_logged_at = now
            log.warning(
                "%d client connections open, the cap (--max-client-connections): %s",
                len(self.connections),
                what,
            )

    def short_of_budget(self) -> None:
        """Logged at most once a minute, as `_full` is."""
        self.short_of_room += 1
        now = asyncio.get_running_loop().time()
        if now - self._short_logged_at >= _FULL_LOG_EVERY_SECS:
            self._short_logged_at = now
            log.warning(
                "request bodies held fill %d of the %d bytes of --max-buffered-payload-size: "
                "a body refused, 503 (%d since the start)",
                self.budget.used,
                self.budget.total,
                self.short_of_room,
            )

    def lost(self, connection: ClientConnection) -> None:
        self.connections.discard(connection)
        if not self.connections and self._emptied is not None and not self._emptied.done():
            self._emptied.set_result(None)

    def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        self.expire(loop.time())
        self._sweeper = loop.call_later(self._sweep_every, self._sweep)

    def expire(self, now: float) -> None:
        """Close the connections that waited on their client too long at loop time `now`
        (called every `min(keep_alive_secs, read_timeout_secs) / 2`; tests call it)."""
        for connection in list(self.connections):
            connection.expire(now, self._keep_alive, self._read_timeout)

    async def shutdown(self, grace: float = 10.0) -> None:
        """Stop accepting, let answers in progress finish for up to `grace` s, close all."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.close()
        if self.connections:
            self._emptied = asyncio.get_running_loop().create_future()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace):
                    await self._emptied
        for connection in list(self.connections):
            connection.abort()
        if self._server is not None:
            await self._server.wait_closed()
