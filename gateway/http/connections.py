"""The gateway's HTTP/1.1 client: keep-alive connections to the workers on asyncio protocols.

Why not httpx's own machinery on the request path: each call through `httpx.AsyncClient`
builds a `Request` (URL parsing and merging, header models, cookie extraction) and a
`Response` with its stream wrappers, and a `StreamReader` per connection adds a task
wake-up per read, a large share of the gateway's CPU (`docs/gateway-design.md`). Here a
call is one `transport.write` of prebuilt bytes, and the answer is parsed by httptools (C)
inside `data_received`, which resolves a future: no task, no stream object.
`gateway.http.transport` puts httpx's interface on top of this for the calls off the hot
path (health checks, directory reads, index lookups).

Host names are resolved by a `HostResolver` (one lookup in flight per name, its answer
kept briefly), so a worker whose name stops resolving cannot stall the others' lookups.

Each origin keeps a stack of idle connections (`gateway.http.connection`, one each):
taking one is a pop (one the peer closed while idle has seen EOF and is skipped without a
system call), giving it back a push. A connection returns to its stack as soon as its
answer has been read to the end (the rest of the body stays buffered in the `Reply`)
unless either side asked to close it. Cancelling a call's future before its answer ended
closes the connection, so the worker sees the client go. A request written to a reused
connection that the peer closed before any byte of an answer arrived (the keep-alive
race) is sent once more on a new connection.

Errors are httpx's exception types (`ConnectError`, `ReadTimeout`, `RemoteProtocolError`,
…) so their callers handle both clients alike; a connection this process cannot open for
want of its own resources (file descriptors, memory, socket buffers) is a
`LocalResourceError` instead, which says nothing about the worker and must not be held
against it. The read timeout is the longest silence
allowed while an answer is awaited; a stream whose reader has paused it is not timed out.
Not supported: HEAD answers are complete at their head (the connection is then closed),
request bodies are whole bytes, and 1xx interim answers are not expected (none is asked).
"""

from __future__ import annotations

import asyncio
import errno
import math
import os
import resource
import ssl
from collections.abc import Sequence
from urllib.parse import urlsplit

import httpx

from gateway.http.connection import DEAD_PEER_SECS, Connection, Origin
from gateway.http.reply import Listener, Reply
from gateway.http.resolver import HostResolver

Headers = Sequence[tuple[bytes, bytes]]

_TARGETS_KEPT = 4096


_LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
"""Failures to connect that are this process's or this host's, never the peer's."""


class LocalResourceError(httpx.TransportError):
    """A connection could not be opened for want of this process's own resources."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.errno = code


def _open_files_limit() -> str:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return "unlimited" if soft == resource.RLIM_INFINITY else str(soft)


def _local_error(host: str, port: int, exc: OSError) -> LocalResourceError:
    name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    message = (
        f"this process could not open a connection to {host}:{port}: {name} "
        f"({os.strerror(exc.errno or 0)}; its open-files limit is {_open_files_limit()})"
    )
    return LocalResourceError(message, exc.errno or 0)


class ConnectionPool:
    """Idle keep-alive connections per origin, and the calls made on them."""

    def __init__(
        self,
        *,
        max_idle_per_origin: int = 256,
        ssl_context: ssl.SSLContext | None = None,
        resolver: HostResolver | None = None,
    ) -> None:
        self._resolver = resolver or HostResolver()
        self._idle: dict[Origin, list[Connection]] = {}
        self._max_idle = max_idle_per_origin
        self._ssl = ssl_context
        self._targets: dict[object, tuple[Origin, bytes]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        """The loop of the first call, which every connection belongs to. Kept because
        `asyncio.get_running_loop()` costs a getpid() system call (fork detection), which
        per request was a noticeable share of the CPU."""
        self._waiting: set[Connection] = set()
        """Connections awaiting an answer that has a read timeout."""
        self._check: asyncio.TimerHandle | None = None
        self._check_at = math.inf

    def request(
        self,
        method: bytes,
        url: str,
        body: bytes = b"",
        *,
        headers: Headers = (),
        more: Headers = (),
        timeout: float | None,
        connect_timeout: float | None = None,
        whole: bool,
    ) -> asyncio.Future[Reply]:
        """Send now; the future resolves at the answer's head, or with `whole` at its end.

        `more`: header lines of this call alone (a request id, a trace context), never
        cached with the head. `timeout` bounds each silence while the answer is awaited;
        `connect_timeout` (default `timeout`) bounds opening a connection. Raises
        ValueError for a URL that is not http(s).
        """
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        future: asyncio.Future[Reply] = loop.create_future()
        reply = self.call(
            method,
            url,
            body,
            headers=headers,
            more=more,
            timeout=timeout,
            connect_timeout=connect_timeout,
            whole=whole,
            future=future,
        )
        future.add_done_callback(reply.settled)
        return future

    def call(
        self,
        method: bytes,
        url: str,
        body: bytes = b"",
        *,
        headers: Headers = (),
        more: Headers = (),
        timeout: float | None,
        connect_timeout: float | None = None,
        whole: bool,
        future: asyncio.Future[Reply] | None = None,
        listener: Listener | None = None,
    ) -> Reply:
        """`request`, followed by `listener` (or `future`) instead of a future made here:
        the call's `Reply`, which `close` abandons."""
        origin, head = self._target(method, url, headers)
        lines = [head]
        for name, value in more:
            lines.append(name + b": " + value + b"\r\n")
        if body or method in (b"POST", b"PUT", b"PATCH"):
            lines.append(b"Content-Length: %d\r\n" % len(body))
        lines += (b"\r\n", body)
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        response = Reply(loop, b"".join(lines), timeout, whole, future, listener)
        self._send(origin, response, timeout if connect_timeout is None else connect_timeout)
        return response

    def _target(self, method: bytes, url: str, headers: Headers) -> tuple[Origin, bytes]:
        """The origin and the request's head up to Content-Length, cached per call shape
        when `headers` is a tuple (`gateway.http.upstream`'s fixed headers)."""
        cached = isinstance(headers, tuple)
        key = (method, url, headers) if cached else None
        found = self._targets.get(key) if cached else None
        if found is not None:
            return found
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        origin = (parts.scheme, parts.hostname, port)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        host = parts.netloc.rpartition("@")[2]
        head = b"%s %s HTTP/1.1\r\nHost: %s\r\n" % (method, path.encode(), host.encode())
        head += b"".join(name + b": " + value + b"\r\n" for name, value in headers)
        if cached:
            if len(self._targets) >= _TARGETS_KEPT:
                self._targets.clear()
            self._targets[key] = (origin, head)
        return origin, head

    def _send(self, origin: Origin, response: Reply, connect_timeout: float | None) -> None:
        idle = self._idle.get(origin)
        while idle:
            connection = idle.pop()
            if connection.usable():
                connection.send(response)
                return
        task = asyncio.get_running_loop().create_task(
            self._connect_and_send(origin, response, connect_timeout)
        )
        response.task = task

    def resend(self, origin: Origin, response: Reply) -> None:
        """A reused connection closed before answering: once more on a new connection."""
        response.connection = None
        task = asyncio.get_running_loop().create_task(
            self._connect_and_send(origin, response, response.timeout)
        )
        response.task = task

    async def _connect_and_send(
        self, origin: Origin, response: Reply, timeout: float | None
    ) -> None:
        scheme, host, port = origin
        context = (self._ssl or ssl.create_default_context()) if scheme == "https" else None
        loop = asyncio.get_running_loop()
        address: str | None = None
        bound = DEAD_PEER_SECS if timeout is None else min(timeout, DEAD_PEER_SECS)
        try:
            async with asyncio.timeout(bound):
                address = await self._resolver.resolve(host, port)
                _, connection = await loop.create_connection(
                    lambda: Connection(self, origin),
                    address,
                    port,
                    ssl=context,
                    server_hostname=host if context else None,
                )
        except TimeoutError:
            if address is not None:  # the address may be stale: resolve again next time
                self._resolver.forget(host, port)
            response.on_error(httpx.ConnectTimeout(f"connecting to {host}:{port} timed out"))
            return
        except OSError as exc:
            if exc.errno in _LOCAL_ERRNOS:
                response.on_error(_local_error(host, port, exc))
                return
            if address is not None:
                self._resolver.forget(host, port)
            response.on_error(httpx.ConnectError(f"{host}:{port}: {exc}"))
            return
        finally:
            response.task = None
        future = response.future
        if response.done or (future is not None and future.cancelled()):
            self.release(origin, connection)  # unused: good for the next call
            return
        connection.send(response)

    def watch(self, connection: Connection, deadline: float) -> None:
        """Read timeouts: one timer for the pool, due at the earliest deadline, rather than
        a timer per call (creating and cancelling two per request cost CPU on every request)."""
        self._waiting.add(connection)
        if deadline < self._check_at:
            if self._check is not None:
                self._check.cancel()
            assert self._loop is not None
            self._check = self._loop.call_at(deadline, self._check_timeouts)
            self._check_at = deadline

    def unwatch(self, connection: Connection) -> None:
        self._waiting.discard(connection)

    def _check_timeouts(self) -> None:
        assert self._loop is not None
        self._check, self._check_at = None, math.inf
        now = self._loop.time()
        due = [c.check_timeout(now) for c in list(self._waiting)]
        deadlines = [d for d in due if d is not None]
        if deadlines:
            self._check_at = min(deadlines)
            self._check = self._loop.call_at(self._check_at, self._check_timeouts)

    def release(self, origin: Origin, connection: Connection) -> None:
        idle = self._idle.setdefault(origin, [])
        if len(idle) >= self._max_idle:
            connection.abort()
            return
        connection.reused = True
        idle.append(connection)

    async def aclose(self) -> None:
        if self._check is not None:
            self._check.cancel()
        for idle in self._idle.values():
            for connection in idle:
                connection.abort()
        self._idle.clear()
