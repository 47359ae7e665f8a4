"""One client's connection as the gateway writes to it and ends it: the transport, the
connection's life as one `ConnectionState` (OPEN, CLOSING, LINGERING after a refusal,
CLOSED), write flow control for streamed answers, and waiting for the client to go.

`gateway.http.client_connection.ClientConnection` builds on it with the requests read from
the connection and answered in order; `gateway.http.wire` writes answers through it.
"""

from __future__ import annotations

import asyncio
import enum
from typing import Any, cast


def _host_port(address: Any) -> tuple[str, int] | None:
    """An address as ASGI's `client`/`server` take it: IPv6 socket names carry flow info
    and a scope id besides, which Starlette's `request.client` cannot unpack."""
    if isinstance(address, tuple) and len(address) >= 2:
        return str(address[0]), int(address[1])
    return None


class ConnectionState(enum.Enum):
    OPEN = "open"
    """Reading requests and answering them in order."""
    CLOSING = "closing"
    """No more requests read; the transport is closed once the answer in progress ends."""
    LINGERING = "lingering"
    """A refusal written and the writing side shut; what the client sends is dropped until
    it closes too (or `expire` does)."""
    CLOSED = "closed"
    """The transport is gone."""


class ClientWire(asyncio.Protocol):
    """The writing side and the life of one client's connection."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self.state = ConnectionState.OPEN
        self._lingering_since = 0.0
        """Loop time LINGERING began."""
        self._reading_paused = False
        """Reading paused: requests wait to be answered."""
        self.write_paused = False
        self._drained: asyncio.Future[None] | None = None
        self._lost: asyncio.Future[None] | None = None
        self.peer: tuple[str, int] | None = None
        self.local: tuple[str, int] | None = None

    def _open(self) -> bool:
        return self.state is ConnectionState.OPEN

    def _stop_reading_requests(self) -> None:
        """OPEN → CLOSING; a connection already past OPEN stays where it is."""
        if self.state is ConnectionState.OPEN:
            self.state = ConnectionState.CLOSING

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.peer = _host_port(transport.get_extra_info("peername"))
        self.local = _host_port(transport.get_extra_info("sockname"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.state = ConnectionState.CLOSED
        for waiter in (self._drained, self._lost):
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def _linger(self) -> None:
        """Close the writing side only, and drop what the client still sends until it
        closes too (or `expire` does): closed at once with unread bytes (a body refused
        before it was read), the socket would reset and the client lose the refusal."""
        transport = self._transport
        assert transport is not None
        if self.state in (ConnectionState.LINGERING, ConnectionState.CLOSED):
            return
        if transport.is_closing() or not transport.can_write_eof():
            transport.close()
            return
        self.state = ConnectionState.LINGERING
        self._lingering_since = self._loop.time()
        if self._reading_paused:
            self._reading_paused = False
            transport.resume_reading()
        transport.write_eof()

    # gateway.http.wire.Wire

    def write(self, data: bytes) -> None:
        if self.state is not ConnectionState.CLOSED and self._transport is not None:
            self._transport.write(data)

    async def drain(self) -> None:
        if self.write_paused and self.state is not ConnectionState.CLOSED:
            self._drained = self._loop.create_future()
            await self._drained

    async def disconnected(self) -> None:
        if self.state is ConnectionState.CLOSED:
            return
        if self._lost is None:
            self._lost = self._loop.create_future()
        await asyncio.shield(self._lost)
