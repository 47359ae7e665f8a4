"""A lean HTTP/1.1 keep-alive transport for the gateway's one httpx client.

Why not httpx's default (httpcore): every request taken from or returned to its pool
scans all pooled connections, and each idle one is checked with a `select` system call
(`is_socket_readable`). With the 64 concurrent requests of `bench.gateway`, that scan
took over half of the gateway's CPU and cut its throughput below 200 requests/s.

Here each upstream origin keeps a stack of idle connections: taking one is a pop (a
connection the peer closed while idle has already seen EOF and is dropped without a
system call), giving it back is a push. Only what the gateway needs is supported:
HTTP/1.1 (TLS for https), request bodies httpx gives as bytes, responses framed by
Content-Length, chunked encoding, or the connection's close. Errors are httpx's own
exception types, so callers and `httpx.MockTransport`-based tests see no difference.

A connection goes back to its stack only when its response was read to the end and
neither side asked to close it; a response closed early closes its connection. A request
written to a reused connection that the peer closed before answering (a keep-alive race)
is sent once more on a new connection: no byte of an answer had arrived.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from http.cookiejar import CookieJar, DefaultCookiePolicy

import httpx

_MAX_HEAD = 64 * 1024
_READ_SIZE = 64 * 1024
Origin = tuple[str, str, int]


@dataclass(eq=False, slots=True)
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    reused: bool = False

    def usable(self) -> bool:
        return not (self.reader.at_eof() or self.writer.is_closing())

    def close(self) -> None:
        self.writer.close()


class _StaleConnection(Exception):
    """A reused connection was closed by the peer before any byte of the answer."""


def _timeouts(request: httpx.Request) -> tuple[float | None, float | None]:
    timeout = request.extensions.get("timeout", {})
    return timeout.get("connect"), timeout.get("read")


class _Body(httpx.AsyncByteStream):
    """A response body read from its connection, which returns to the pool at the end."""

    def __init__(
        self,
        transport: PooledTransport,
        origin: Origin,
        connection: _Connection,
        request: httpx.Request,
        *,
        length: int | None,
        chunked: bool,
        keep: bool,
    ) -> None:
        self._transport = transport
        self._origin = origin
        self._connection = connection
        self._request = request
        self._length = length
        self._chunked = chunked
        self._keep = keep
        self._done = False
        self._closed = False
        self._read_timeout = _timeouts(request)[1]

    async def _read(self, *, exactly: int = 0, most: int = _READ_SIZE) -> bytes:
        reader = self._connection.reader
        try:
            async with asyncio.timeout(self._read_timeout):
                if exactly:
                    return await reader.readexactly(exactly)
                return await reader.read(most)
        except TimeoutError as exc:
            raise httpx.ReadTimeout("reading the answer timed out", request=self._request) from exc
        except asyncio.IncompleteReadError as exc:
            raise httpx.RemoteProtocolError(
                "the peer closed the connection mid-answer", request=self._request
            ) from exc
        except OSError as exc:
            raise httpx.ReadError(repr(exc), request=self._request) from exc

    async def _line(self) -> bytes:
        try:
            async with asyncio.timeout(self._read_timeout):
                return await self._connection.reader.readuntil(b"\r\n")
        except TimeoutError as exc:
            raise httpx.ReadTimeout("reading the answer timed out", request=self._request) from exc
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            raise httpx.RemoteProtocolError(
                "bad chunked framing from the peer", request=self._request
            ) from exc
        except OSError as exc:
            raise httpx.ReadError(repr(exc), request=self._request) from exc

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self._chunked:
            async for chunk in self._chunks():
                yield chunk
        elif self._length is not None:
            left = self._length
            while left:
                data = await self._read(most=min(left, _READ_SIZE))
                if not data:
                    raise httpx.RemoteProtocolError(
                        f"the answer ended {left} bytes short", request=self._request
                    )
                left -= len(data)
                yield data
        else:
            while data := await self._read():
                yield data
            self._keep = False
        self._done = True
        await self.aclose()

    async def _chunks(self) -> AsyncIterator[bytes]:
        while True:
            line = await self._line()
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError as exc:
                raise httpx.RemoteProtocolError(
                    f"bad chunk size {line[:40]!r}", request=self._request
                ) from exc
            if size == 0:
                while await self._line() != b"\r\n":
                    pass
                return
            data = await self._read(exactly=size + 2)
            yield data[:-2]

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._done and self._keep:
            self._transport.release(self._origin, self._connection)
        else:
            self._connection.close()


class PooledTransport(httpx.AsyncBaseTransport):
    def __init__(
        self, *, max_idle_per_origin: int = 256, ssl_context: ssl.SSLContext | None = None
    ):
        self._idle: defaultdict[Origin, list[_Connection]] = defaultdict(list)
        self._max_idle = max_idle_per_origin
        self._ssl = ssl_context

    def release(self, origin: Origin, connection: _Connection) -> None:
        idle = self._idle[origin]
        if len(idle) >= self._max_idle or not connection.usable():
            connection.close()
            return
        connection.reused = True
        idle.append(connection)

    async def _connect(self, origin: Origin, request: httpx.Request) -> _Connection:
        idle = self._idle[origin]
        while idle:
            connection = idle.pop()
            if connection.usable():
                return connection
            connection.close()
        scheme, host, port = origin
        context = None
        if scheme == "https":
            context = self._ssl or ssl.create_default_context()
        try:
            async with asyncio.timeout(_timeouts(request)[0]):
                reader, writer = await asyncio.open_connection(
                    host, port, ssl=context, limit=_MAX_HEAD
                )
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port}", request=request) from exc
        except OSError as exc:
            raise httpx.ConnectError(f"{host}:{port}: {exc}", request=request) from exc
        return _Connection(reader, writer)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        origin = (url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80))
        body = await request.aread()
        head = _head(request, len(body))
        for _ in range(2):
            connection = await self._connect(origin, request)
            try:
                return await self._exchange(origin, connection, request, head + body)
            except _StaleConnection:
                connection.close()
            except BaseException:
                connection.close()
                raise
        raise httpx.RemoteProtocolError(
            "the peer closed two connections unanswered", request=request
        )

    async def _exchange(
        self, origin: Origin, connection: _Connection, request: httpx.Request, data: bytes
    ) -> httpx.Response:
        try:
            connection.writer.write(data)
            async with asyncio.timeout(_timeouts(request)[1]):
                raw = await connection.reader.readuntil(b"\r\n\r\n")
        except TimeoutError as exc:
            raise httpx.ReadTimeout("waiting for the answer timed out", request=request) from exc
        except asyncio.IncompleteReadError as exc:
            if connection.reused and not exc.partial:
                raise _StaleConnection from exc
            raise httpx.RemoteProtocolError(
                "the peer closed without answering", request=request
            ) from exc
        except asyncio.LimitOverrunError as exc:
            raise httpx.RemoteProtocolError("answer headers too large", request=request) from exc
        except OSError as exc:
            if connection.reused:
                raise _StaleConnection from exc
            raise httpx.ReadError(repr(exc), request=request) from exc
        status, headers = _parse_head(raw, request)
        values = {k.lower(): v for k, v in headers}
        keep = values.get(b"connection", b"").lower() != b"close" and raw.startswith(b"HTTP/1.1")
        chunked = b"chunked" in values.get(b"transfer-encoding", b"").lower()
        length: int | None = None
        if request.method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            length = 0
        elif not chunked and b"content-length" in values:
            try:
                length = int(values[b"content-length"])
            except ValueError as exc:
                raise httpx.RemoteProtocolError("bad Content-Length", request=request) from exc
        stream = _Body(self, origin, connection, request, length=length, chunked=chunked, keep=keep)
        return httpx.Response(
            status, headers=headers, stream=stream, extensions={"http_version": b"HTTP/1.1"}
        )

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()


def _head(request: httpx.Request, length: int) -> bytes:
    url = request.url
    target = url.raw_path or b"/"
    lines = [request.method.encode() + b" " + target + b" HTTP/1.1"]
    for name, value in request.headers.raw:
        if name.lower() not in (b"content-length", b"transfer-encoding"):
            lines.append(name + b": " + value)
    if length or request.method in ("POST", "PUT", "PATCH"):
        lines.append(b"Content-Length: " + str(length).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n"


def _parse_head(raw: bytes, request: httpx.Request) -> tuple[int, list[tuple[bytes, bytes]]]:
    lines = raw[:-4].split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise httpx.RemoteProtocolError(f"bad status line {lines[0][:80]!r}", request=request)
    headers: list[tuple[bytes, bytes]] = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            raise httpx.RemoteProtocolError(f"bad header line {line[:80]!r}", request=request)
        headers.append((name.strip(), value.strip()))
    return int(parts[1]), headers


def upstream_client() -> httpx.AsyncClient:
    """The gateway's one client: this transport, and a cookie jar that keeps nothing.

    httpx's default jar would store a worker's Set-Cookie and send it on every later
    request of every user to that worker; a router must pass no state between clients.
    """
    jar = CookieJar(policy=DefaultCookiePolicy(allowed_domains=[]))
    return httpx.AsyncClient(transport=PooledTransport(), cookies=jar)
