"""httpx's interface over the gateway's own connections, for the calls off the hot path.

Health checks, directory reads, pod registration and index lookups go through one
`httpx.AsyncClient` (tests swap its transport for `httpx.MockTransport`). Its transport
here is `gateway.http.connections.ConnectionPool`, the client inference calls use directly, so
there is one connection pool per process and one HTTP/1.1 implementation.

Why not httpx's default (httpcore): every request taken from or returned to its pool
scans all pooled connections, and each idle one is checked with a `select` system call
(`is_socket_readable`), a cost that grows with the connections in use
(`docs/gateway-design.md`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from http.cookiejar import CookieJar, DefaultCookiePolicy

import httpx

from gateway.http.connections import ConnectionPool
from gateway.http.reply import Reply

_OWN_HEADERS = frozenset({b"host", b"content-length", b"transfer-encoding"})
"""Written by the pool from the URL and the body."""


class _Body(httpx.AsyncByteStream):
    def __init__(self, response: Reply) -> None:
        self._response = response

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while piece := await self._response.next():
            yield piece

    async def aclose(self) -> None:
        self._response.close()


class PooledTransport(httpx.AsyncBaseTransport):
    def __init__(self, pool: ConnectionPool | None = None) -> None:
        self.pool = pool or ConnectionPool()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        headers = [(k, v) for k, v in request.headers.raw if k.lower() not in _OWN_HEADERS]
        timeout = request.extensions.get("timeout", {})
        try:
            pending = self.pool.request(
                request.method.encode(),
                str(request.url),
                body,
                headers=headers,
                timeout=timeout.get("read"),
                connect_timeout=timeout.get("connect"),
                whole=False,
            )
        except ValueError as exc:
            raise httpx.UnsupportedProtocol(str(exc), request=request) from exc
        try:
            response = await pending
        except httpx.TransportError as exc:
            exc.request = request
            raise
        return httpx.Response(
            response.status,
            headers=response.headers,
            stream=_Body(response),
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def aclose(self) -> None:
        await self.pool.aclose()


def upstream_client(pool: ConnectionPool | None = None) -> httpx.AsyncClient:
    """The gateway's httpx client on `pool`, with a cookie jar that keeps nothing.

    httpx's default jar would store a worker's Set-Cookie and send it on every later
    request of every user to that worker; a router must pass no state between clients.
    """
    jar = CookieJar(policy=DefaultCookiePolicy(allowed_domains=[]))
    return httpx.AsyncClient(transport=PooledTransport(pool), cookies=jar)
