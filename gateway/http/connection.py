"""One keep-alive connection from the gateway to a worker, on an asyncio protocol.

A call is one `transport.write` of prebuilt bytes, and the answer is parsed by httptools
(C) inside `data_received`, which resolves the call's `Reply`: no task, no stream object
(why: `gateway.http.connections`). The connection carries one answer at a time and goes
back to its pool's idle stack once that answer is read to the end, unless either side
asked to close it. A request written to a reused connection that the peer closed before
any byte of an answer arrived (the keep-alive race) goes back to the pool to be sent once
more on a new connection. A worker's host that leaves sent bytes unacknowledged for
`DEAD_PEER_SECS` fails the connection (TCP_USER_TIMEOUT). The read timeout (the longest
silence while an answer is awaited; none while its reader paused it) is checked by the
pool, one timer for all.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Protocol, cast

import httptools
import httpx

from gateway.http.reply import Reply

Origin = tuple[str, str, int]
"""(scheme, host, port)."""

_BODYLESS_STATUSES = frozenset({204, 304})
DEAD_PEER_SECS = 10.0
"""How long a worker's host may leave a connection attempt or sent bytes unacknowledged
before the connection counts as failed (the connect stage, and TCP_USER_TIMEOUT after it).
A killed container or a powered-off host sends no reset: without this bound a request
waited for the whole request timeout on a connection to nobody, where a retry on another
worker answers at once. The kernel acknowledges bytes whatever the worker's own delay, so
a slow prefill is never cut off by it."""
_DEAD_PEER_MS = round(DEAD_PEER_SECS * 1000)


class Pool(Protocol):
    """What a connection needs of the pool it belongs to."""

    def watch(self, connection: Connection, deadline: float) -> None:
        """Check the connection's read timeout from `deadline` on."""
        ...

    def unwatch(self, connection: Connection) -> None: ...

    def resend(self, origin: Origin, response: Reply) -> None:
        """Send `response` again on a new connection (the keep-alive race)."""
        ...

    def release(self, origin: Origin, connection: Connection) -> None:
        """Take the connection back as idle."""
        ...


class Connection(asyncio.Protocol):
    """One keep-alive connection; carries one `Reply` at a time."""

    def __init__(self, pool: Pool, origin: Origin) -> None:
        self._pool = pool
        self._origin = origin
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._response: Reply | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._keep = False
        self._last_read = 0.0
        self.reused = False
        self.closed = False
        self.paused = False

    def usable(self) -> bool:
        return not self.closed and self._transport is not None and not self._transport.is_closing()

    def send(self, response: Reply) -> None:
        assert self._transport is not None
        self._response = response
        response.connection = self
        self._last_read = self._loop.time()
        if response.timeout is not None:
            self._pool.watch(self, self._last_read + response.timeout)
        self._transport.write(response.data)

    def pause(self) -> None:
        if not self.paused and self._transport is not None:
            self.paused = True
            self._transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self._transport is not None:
            self.paused = False
            self._last_read = self._loop.time()
            self._transport.resume_reading()

    def abort(self) -> None:
        """Close now; the response being received, if any, ends with an error."""
        self.closed = True
        if self._transport is not None:
            self._transport.close()
        self._end(httpx.ReadError("the call was cancelled"))

    def check_timeout(self, now: float) -> float | None:
        """Fail the call when silent for its timeout; else when to look again (None: done)."""
        response = self._response
        if response is None or response.timeout is None:
            return None
        if self.paused:
            self._last_read = now  # the reader holds it back, not the worker
        if now - self._last_read < response.timeout:
            return self._last_read + response.timeout
        self.closed = True
        if self._transport is not None:
            self._transport.close()
        self._end(httpx.ReadTimeout(f"no answer for {response.timeout:g} s"))
        return None

    def _end(self, error: BaseException | None) -> None:
        response, self._response = self._response, None
        self._pool.unwatch(self)
        if response is None:
            return
        if error is None:
            response.on_end()
        else:
            response.on_error(error)

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None and hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, _DEAD_PEER_MS)

    def data_received(self, data: bytes) -> None:
        if self._response is None:
            self.abort()  # bytes nobody asked for: the connection cannot be trusted
            return
        self._last_read = self._loop.time()
        response = self._response
        try:
            self._parser.feed_data(data)
            response.flush()
        except httptools.HttpParserError as exc:
            self.closed = True
            assert self._transport is not None
            self._transport.close()
            self._end(httpx.RemoteProtocolError(f"malformed answer from {self._name()}: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        response = self._response
        if response is None:
            return
        if not response.received and self.reused:
            self._response = None
            self._pool.unwatch(self)
            self._pool.resend(self._origin, response)
        elif response.status and not _framed(response) and exc is None:
            self._end(None)  # an answer delimited by the connection's close
        elif response.status:
            self._end(httpx.RemoteProtocolError(f"{self._name()} closed the connection mid-answer"))
        elif exc is not None:
            self._end(httpx.ReadError(f"{self._name()}: {exc!r}"))
        else:
            self._end(httpx.RemoteProtocolError(f"{self._name()} closed without answering"))

    # httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        response = self._response
        if response is None:
            return
        status = self._parser.get_status_code()
        headers, self._headers = self._headers, []
        self._keep = self._parser.should_keep_alive()
        response.on_head(status, headers)
        if response.head_only:
            self._keep = False
            self.closed = True
            assert self._transport is not None
            self._transport.close()
            self._end(None)

    def on_body(self, body: bytes) -> None:
        if self._response is not None:
            self._response.on_piece(body)

    def on_message_complete(self) -> None:
        if self._response is None:
            return
        self._end(None)
        if self._keep and not self.closed:
            self.resume()  # paused by this answer's reader, it must read the next one
            self._pool.release(self._origin, self)
        else:
            self.closed = True
            assert self._transport is not None
            self._transport.close()

    def _name(self) -> str:
        return f"{self._origin[1]}:{self._origin[2]}"


def _framed(response: Reply) -> bool:
    """The answer's end is marked (Content-Length, chunked), not the connection's close:
    asked only when the connection closes mid-answer, not of every answer."""
    return response.status in _BODYLESS_STATUSES or any(
        name.lower() in (b"content-length", b"transfer-encoding") for name, _ in response.headers
    )
