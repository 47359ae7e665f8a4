"""The gateway's HTTP/1.1 server: inference on asyncio protocols, every other route by the app.

Why its own server rather than uvicorn (which serves every other globalkv service) or
granian: `python -m bench.gateway` serves the same gateway code each way, side by side in
interleaved runs (the figures and their commands are in the README and `bench/results/gateway.md`,
`bench/results/gateway-granian.md`), and under either it spends clearly more CPU per
answered request than here, streamed or not, and answers fewer requests/s:
- uvicorn: the ASGI request path costs it: message dicts, Starlette's middleware stack,
  and a task per request listening for the client's disconnect, which here is
  `connection_lost`, at no cost per request.
- granian, even on RSGI (its leaner interface) and its Rust task implementation: each
  request crosses from granian's Rust threads into the Python event loop and its answer
  back (a thread hand-off and a loop wake-up per request, and per piece of a stream),
  which costs more than parsing the request with httptools on the loop itself: granian
  answering prebuilt bytes alone costs several times what this server's parser does.
  Noticing a client that leaves costs it a task per request awaiting
  `client_disconnect`; without that (not shippable: a departed client's upstream calls
  would run on) it is still short of this server. What it lacks for this use: serving
  the request on the event loop's own thread, and a disconnect signal that costs nothing
  until it fires.

Against sglang-router the comparison to read is the CPU per request too: both routers are
pinned to the same core, which other processes on a shared machine take from each in
different amounts during each measuring window, so on whole answers, where the two cost
about the same, one run shows the gateway's requests/s above sglang-router's and another
at par or below. On streams the gateway is far ahead in both measures (sglang-router's
reused connections wait on delayed ACKs, see the README).

What this server does instead: each connection is a `gateway.http.client_connection`
protocol, which parses requests with httptools in `data_received` and answers each in
order with a `gateway.http.exchange.Exchange`: inference through `gateway.inference` (one task
per request, the answer written as prebuilt bytes), every other request (admin, info,
health, metrics) to the ASGI app (FastAPI), so those routes keep their one
implementation. Here: listening, timeouts for clients that make a connection wait (idle
keep-alive connections closed after `keep_alive_secs`; a request whose head takes longer
than `read_timeout_secs` to arrive, or whose body stalls that long, answered 408 and
closed — a few slow clients must not hold connections forever), and a graceful
`shutdown` (stop accepting, finish what is in flight, then close).
"""

from __future__ import annotations

import asyncio
import contextlib

from starlette.types import ASGIApp

from gateway.http.client_connection import ClientConnection
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
                async with asyncio.timeout(grace):
                    await self._emptied
        for connection in list(self.connections):
            connection.abort()
        if self._server is not None:
            await self._server.wait_closed()
