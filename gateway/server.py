"""The gateway's HTTP/1.1 server: inference on asyncio protocols, every other route by the app.

Why not uvicorn, which DESIGN.md names: measured with `python -m bench.gateway` on this
project's 2-CPU machine (router pinned alone on one core; CPU time per answered request,
which on a shared machine is steadier than requests/s), the same gateway code costs

    per request, concurrency 16 and 64   whole answer   streamed (9 SSE events)
    served by uvicorn (uvloop, httptools)  138-143 µs      177-193 µs
    served by this server                   87-89 µs      106-116 µs
    sglang-router 0.3.2, for reference     106-115 µs      179-238 µs

and on uvicorn it stayed below sglang-router's requests/s (5.2-5.6k against 6.0-6.8k
whole), here above it (8.3-9.7k). The bare servers account for ~17 µs of the difference
(`bench.gateway_ceilings`: uvicorn with a bare ASGI app 22-23 µs per request, this
parser with a prebuilt answer 5-6 µs); the rest is the ASGI request path: message
dicts, Starlette's middleware stack, and a task per request listening for the client's
disconnect, which here is `connection_lost`, at no cost per request.

What this server does instead: each connection is a `gateway.client_connection`
protocol, which parses requests with httptools in `data_received`, answers inference
itself through `gateway.inference` (one task per request, the answer written as prebuilt
bytes) and hands every other request (admin, info, health, metrics) to the ASGI app
(FastAPI), so those routes keep their one implementation. Here: listening, timeouts for
clients that make a connection wait (idle keep-alive connections closed after
`keep_alive_secs`; a request whose head takes longer than `read_timeout_secs` to arrive,
or whose body stalls that long, answered 408 and closed — a few slow clients must not hold
connections forever), and a graceful `shutdown` (stop accepting, finish what is in
flight, then close).
"""

from __future__ import annotations

import asyncio
import contextlib

from starlette.types import ASGIApp

from gateway.client_connection import ClientConnection
from gateway.inference import Inference


class GatewayServer:
    """Listens, serves each connection with a `ClientConnection`, and stops gracefully."""

    def __init__(
        self,
        inference: Inference,
        app: ASGIApp,
        *,
        keep_alive_secs: float = 5.0,
        read_timeout_secs: float = 30.0,
    ):
        self.inference = inference
        self.app = app
        self.limit = inference.max_payload_size
        self.connections: set[ClientConnection] = set()
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
                await asyncio.wait_for(asyncio.shield(self._emptied), grace)
        for connection in list(self.connections):
            connection.abort()
        if self._server is not None:
            await self._server.wait_closed()
