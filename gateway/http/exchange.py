"""Serving one request on a client's connection: a refusal, the handler, or the ASGI app.

`gateway.http.client_connection` owns the connection's life (parsing, order, timeouts,
closing); an `Exchange` answers one complete request on it and says whether the
connection may serve another. POSTs to the paths the `Handler` claims (inference) go to it
and its answer is written as prebuilt bytes; any other method on those paths is answered
405 here, but for `OPTIONS` (a CORS preflight, which the app answers); every other
request goes to the ASGI app through `gateway.http.wire.serve_asgi`.

A handler may instead take a complete request over to answer it by callbacks (`begin`,
which returns its `Relaying`): the connection then holds no task for it, and the handler
writes the answer itself and says when it is over (`RelayWire.answered`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Protocol

from starlette.types import ASGIApp

from gateway.http.answer import Answer, over_budget, problem, too_large
from gateway.http.wire import (
    CLOSE,
    HttpRequest,
    Wire,
    answer_bytes,
    connection_header,
    serve_asgi,
    write_stream,
)
from kvplumbing.budget import BodyBudget

log = logging.getLogger(__name__)

_ALLOW_POST = b"allow: POST\r\n"
Headers = Sequence[tuple[bytes, bytes]]


class Handler(Protocol):
    """What answers the POSTs the server serves itself (inference)."""

    @property
    def paths(self) -> Collection[str]:
        """The paths it answers; other methods there are answered 405."""
        ...

    @property
    def limit(self) -> int:
        """The largest request body it takes, in bytes (413 beyond)."""
        ...

    async def handle(
        self, path: str, authorization: str | None, body: bytes, headers: Headers = ()
    ) -> Answer:
        """The answer to a POST of `body` to `path` (`headers`: the request's, names in
        lowercase, its trace context among them); cancelled when the client leaves."""
        ...

    def refused(self, path: str, answer: Answer) -> None:
        """The server answered a request to `path` itself (413, 503), without calling
        `handle`."""
        ...

    def begin(self, request: HttpRequest, wire: RelayWire) -> Relaying | None:
        """Take `request` (complete, to one of `paths`) over to answer it by callbacks on
        `wire`; None leaves it to `handle`."""
        ...


class Relaying(Protocol):
    """A request a handler answers by callbacks (`Handler.begin`)."""

    def start(self) -> None:
        """Begin answering (it may be over before this returns)."""
        ...

    def cancel(self) -> None:
        """The client left: stop, write nothing more (`RelayWire.answered` then)."""
        ...

    def drained(self) -> None:
        """The client took what was written: a stream held back may go on."""
        ...


class RelayWire(Wire, Protocol):
    """What answering by callbacks needs of the client's connection."""

    def accepting(self) -> bool:
        """The connection still takes requests (a kept-alive answer may say so)."""
        ...

    def answered(self, request: HttpRequest, kept: bool) -> None:
        """`request`'s answer is over (written, or abandoned when the client left);
        `kept`: the connection may serve another request."""
        ...


async def write_answer(wire: Wire, answer: Answer, *, version: str, keep_alive: bool) -> bool:
    """`answer`, whole or streamed; True when the connection may serve another request."""
    if answer.rest is None:
        wire.write(answer_bytes(answer, connection_header(keep_alive, version)))
        return keep_alive
    # False for HTTP/1.0 or a stream cut short upstream: the close ends the body.
    return await write_stream(wire, answer, version=version, keep_alive=keep_alive)


class Serving(Protocol):
    """What serving a request needs of the server."""

    handler: Handler
    app: ASGIApp
    routes: Mapping[bytes, str]
    """The handler's paths, as they arrive on the wire."""
    limit: int
    """The handler's `limit`."""
    budget: BodyBudget
    """The bytes of request bodies held at once, every connection's together."""


def refusal(server: Serving, request: HttpRequest) -> Answer:
    """The answer to `request`, refused before it was read whole (413 over the per-request
    limit, 503 over the budget), told to the handler when it was one of its requests."""
    budget = server.budget
    answer = too_large(server.limit) if request.refused == 413 else over_budget(budget.total)
    if request.route is not None:
        server.handler.refused(request.route, answer)
    return answer


class Exchange:
    """One request and its answer; `answered` once any of the answer has been written."""

    __slots__ = ("_accepting", "_local", "_peer", "_request", "_server", "_wire", "answered")

    def __init__(
        self,
        server: Serving,
        wire: Wire,
        request: HttpRequest,
        *,
        accepting: Callable[[], bool],
        peer: Any,
        local: Any,
    ) -> None:
        self._server = server
        self._wire = wire
        self._request = request
        self._accepting = accepting
        """Whether the connection still takes requests (not closing), asked when answering."""
        self._peer = peer
        self._local = local
        self.answered = False

    async def run(self) -> bool:
        """Answer the request; True when the connection may serve another. An error before
        anything was written is answered 500; cancelling it (the client left) propagates."""
        request = self._request
        try:
            if request.refused:
                self._write(refusal(self._server, request), CLOSE)
                return False
            if request.route is not None:
                return await self._handle(request, request.route)
            if request.path in self._server.routes and request.method != b"OPTIONS":
                answer = problem(405, f"{request.path.decode()} takes POST")
                keep_alive = self._keep_alive()
                self._write(answer, self._connection(keep_alive), _ALLOW_POST)
                return keep_alive
            return await self._asgi(request)
        except Exception:
            log.exception("error serving %s %s", request.method.decode(), request.path.decode())
            if not self.answered:
                self._write(problem(500, "internal error"), CLOSE)
            return False

    def _keep_alive(self) -> bool:
        return self._request.keep_alive and self._accepting()

    def _connection(self, keep_alive: bool) -> bytes:
        return connection_header(keep_alive, self._request.version)

    def _write(self, answer: Answer, connection: bytes, extra: bytes = b"") -> None:
        self.answered = True
        data = answer_bytes(answer, connection, extra)
        if self._request.method == b"HEAD":
            data = data[: len(data) - len(answer.body)]
        self._wire.write(data)

    async def _handle(self, request: HttpRequest, path: str) -> bool:
        authorization = request.authorization
        body = b"".join(request.body)
        request.body.clear()  # held once, not twice, while it is served
        answer = await self._server.handler.handle(
            path,
            None if authorization is None else authorization.decode("latin-1"),
            body,
            request.headers,
        )
        self.answered = True
        return await write_answer(
            self._wire, answer, version=request.version, keep_alive=self._keep_alive()
        )

    async def _asgi(self, request: HttpRequest) -> bool:
        self.answered = True  # the bridge answers, whatever happens
        return await serve_asgi(
            self._server.app,
            self._wire,
            request,
            keep_alive=self._keep_alive(),
            client=self._peer,
            server=self._local,
        )
