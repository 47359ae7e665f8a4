"""One client's HTTP/1.1 connection to the gateway, on an asyncio protocol: its life.

httptools parses requests in `data_received`; each complete request is answered by a
`gateway.http.exchange.Exchange` in one task, in order, unless the handler takes it over to
answer it by callbacks (`Handler.begin`: a `Relaying`, which says when its answer is over
through `answered`). A client that goes away is seen in `connection_lost`, which cancels
the request's task or relay — and with it both upstream calls — at no cost per request.

The connection's life is one `ConnectionState`: OPEN, CLOSING, LINGERING (after a
refusal), CLOSED; its writing side and its end are `gateway.http.client_wire`'s.

HTTP/1.1 keep-alive with pipelined requests answered in order (reading pauses while a few
wait, and the next starts once the client has taken the last answer), `Expect:
100-continue`, `--max-payload-size` enforced from Content-Length before reading (413) and
while reading chunked bodies, a bound on heads (431), Upgrade headers ignored, and write
flow control for streams. `gateway.http.server.HttpServer` listens, asks each connection
to `expire` a client too slow or silent (408), and shuts down.

Every connection's bodies draw on the server's one `kvplumbing.budget.BodyBudget`
(`--max-buffered-payload-size`): a request takes its body's bytes as they arrive and gives
them all back when its answer is over, it is refused, or the connection is lost (requests
queued or still arriving included). A Content-Length that cannot fit now is refused before
the body is read, and a body that stops fitting as it arrives is refused then: 503, and
the connection closed as after a 413.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Protocol

import httptools

from gateway.http.answer import Answer, problem
from gateway.http.client_wire import ClientWire, ConnectionState
from gateway.http.exchange import Exchange, Relaying, Serving, refusal
from gateway.http.wire import CLOSE, HttpRequest, answer_bytes

log = logging.getLogger(__name__)

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_QUEUED_MAX = 8
"""Pipelined requests held before reading from the client pauses."""
HEAD_MAX = 64 * 1024
"""Bytes of a request line and headers still arriving past which 431 closes the connection
(the chunk a head starts in is not counted: it is bounded by the transport's read size)."""


class Server(Serving, Protocol):
    """What a connection needs of the server that accepted it."""

    def admit(self, connection: ClientConnection) -> None:
        """Serve `connection`, or refuse it (closing it) when the server is full."""
        ...

    def short_of_budget(self) -> None:
        """A body was refused for want of room in the budget."""
        ...

    def lost(self, connection: ClientConnection) -> None: ...


class _UpgradeBody:
    """A request that asked for a protocol upgrade, its body still to be taken by length
    (httptools stops parsing at the head of such a request)."""

    __slots__ = ("left", "request")

    def __init__(self, request: HttpRequest) -> None:
        self.request = request
        self.left = 0


class ClientConnection(ClientWire):
    """One client's connection: requests parsed as bytes arrive, answered in order."""

    def __init__(self, server: Server) -> None:
        super().__init__()
        self._server = server
        self._parser = httptools.HttpRequestParser(self)
        self._request: HttpRequest | None = None
        """The request whose head or body is arriving."""
        self._upgrading: _UpgradeBody | None = None
        self._queue: deque[HttpRequest] = deque()
        """Complete requests waiting for the answer in progress."""
        self._task: asyncio.Task[None] | Relaying | None = None
        """The answer in progress."""
        self._written: HttpRequest | None = None
        """The request whose answer a relay has written, waiting for the client to take
        it before the next is answered."""
        self.last_active = self._loop.time()

    @property
    def idle(self) -> bool:
        return not (self._task or self._request or self._upgrading or self._queue)

    def close(self) -> None:
        """Close now, or after the answer in progress when there is one (a request still
        arriving is dropped)."""
        self._stop_reading_requests()
        if self._task is None and self._transport is not None:
            self._transport.close()

    def expire(self, now: float, idle_secs: float, read_secs: float) -> None:
        """Close the connection if it waits on a silent or slow client: idle between
        requests for `idle_secs`; or, with a request arriving (408), its head not complete
        `read_secs` after its first byte or its body silent for `read_secs`. An answer in
        progress has its own timeouts (the upstream call's)."""
        if self._task is not None or self._transport is None:
            return
        if self.state is ConnectionState.LINGERING:
            if now - self._lingering_since > idle_secs:
                self._transport.close()
            return
        if self.state is not ConnectionState.OPEN:
            return
        if self.idle:
            if now - self.last_active > idle_secs:
                self.close()
            return
        upgrading = self._upgrading
        request = self._request or (upgrading.request if upgrading is not None else None)
        assert request is not None
        if now - (self.last_active if request.method else request.started) > read_secs:
            self._refuse(problem(408, f"the request did not arrive within {read_secs:g} s"))

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._server.admit(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.state = ConnectionState.CLOSED
        self._server.lost(self)
        if self._task is not None:
            self._task.cancel()  # its request's bytes are given back as it ends
        for request in (self._request, *self._queue):
            if request is not None:
                self._give_back(request)
        if self._upgrading is not None:
            self._give_back(self._upgrading.request)
        super().connection_lost(exc)  # then what waits for the client to go

    def data_received(self, data: bytes) -> None:
        if self.state is not ConnectionState.OPEN:
            return  # what follows an answer that closes the connection is not read
        self.last_active = self._loop.time()
        if self._upgrading is not None:
            data = self._upgrade_body(data)
        arriving = self._request
        if arriving is not None and arriving.method:
            arriving = None  # only a head still arriving is watched
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            self._skip_upgrade(data[upgrade.args[0] :])
        except httptools.HttpParserCallbackError:
            log.exception("error parsing a request from %s", self.peer)
            self._refuse(problem(500, "internal error", "internal_error"))
        except httptools.HttpParserError as exc:
            self._refuse(problem(400, f"malformed HTTP request: {exc}"))
        else:
            if arriving is not None and self._request is arriving and not arriving.method:
                self._head_grew(arriving, len(data))  # the whole chunk was more of its head

    def _head_grew(self, request: HttpRequest, size: int) -> None:
        request.head_size += size
        if request.head_size > HEAD_MAX:
            message = f"the request line and headers exceed {HEAD_MAX // 1024} KiB"
            self._refuse(problem(431, message))

    # httptools callbacks

    def on_message_begin(self) -> None:
        self._request = HttpRequest(self.last_active)

    def on_url(self, url: bytes) -> None:
        assert self._request is not None
        self._request.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self._request is not None
        self._request.add_header(name, value)

    def on_headers_complete(self) -> None:
        request = self._request
        assert request is not None
        parser = self._parser
        request.head_complete(
            parser.get_method(), parser.get_http_version(), parser.should_keep_alive()
        )
        if request.method == b"POST":
            request.route = self._server.routes.get(request.path)
        length = request.length
        announced = int(length) if length is not None and length.isdigit() else None
        if announced is not None and announced > self._server.limit:
            self._refuse_body(request, 413)
        elif announced is not None and not self._server.budget.fits(announced):
            self._refuse_body(request, 503)
        elif request.expect and self.idle_but(request):
            self.write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        request = self._request
        assert request is not None
        if request.refused:
            return
        request.size += len(body)
        if request.size > self._server.limit:
            self._refuse_body(request, 413)
        else:
            self._take(request, body)

    def on_message_complete(self) -> None:
        request, self._request = self._request, None
        assert request is not None
        if request.refused and not self._open():
            return  # answered already
        if self._parser.should_upgrade():
            self._upgrading = _UpgradeBody(request)  # httptools raises HttpParserUpgrade next
            return
        self._complete(request)

    def _complete(self, request: HttpRequest) -> None:
        if self._task is None:
            self._start(request)
            return
        self._queue.append(request)
        if len(self._queue) >= _QUEUED_MAX and not self._reading_paused:
            assert self._transport is not None
            self._reading_paused = True
            self._transport.pause_reading()

    # refusals

    def idle_but(self, request: HttpRequest) -> bool:
        """No answer in progress or waiting besides `request`'s."""
        return self._task is None and not self._queue and self._request is request

    def _take(self, request: HttpRequest, body: bytes) -> None:
        """Keep `body`, more of `request`'s, if the budget has room for it; else refuse."""
        if self._server.budget.take(request.held, len(body)):
            request.held += len(body)
            request.body.append(body)
        else:
            self._refuse_body(request, 503)

    def _give_back(self, request: HttpRequest) -> None:
        if request.held:
            self._server.budget.give(request.held)
            request.held = 0

    def _refuse_body(self, request: HttpRequest, status: int) -> None:
        """Drop `request`'s body and refuse it with `status` (answered now when nothing is
        answered before it, else in its turn)."""
        request.refused = status
        request.body = []
        self._give_back(request)
        if status == 503:
            self._server.short_of_budget()
        if self.idle_but(request):
            self._refuse(refusal(self._server, request))

    def _refuse(self, answer: Answer) -> None:
        """Answer now and close: what follows on this connection cannot be trusted.

        With an answer in progress, that one is finished and the connection closed after.
        """
        self._stop_reading_requests()
        if self._task is None and self._transport is not None:
            self.write(answer_bytes(answer, CLOSE))
            self._linger()

    # answering, one request at a time

    def _start(self, request: HttpRequest) -> None:
        if request.route is not None and not request.refused:
            relaying = self._server.handler.begin(request, self)
            if relaying is not None:
                self._task = relaying
                relaying.start()
                return
        exchange = Exchange(
            self._server, self, request, accepting=self._open, peer=self.peer, local=self.local
        )
        self._task = self._loop.create_task(self._serve(exchange, request))

    async def _serve(self, exchange: Exchange, request: HttpRequest) -> None:
        try:
            kept = await exchange.run()
            if self.write_paused:
                await self.drain()  # a client not reading its answers gets no more of them
        except asyncio.CancelledError:
            kept = False  # the client left, or the server is stopping
        finally:
            self._task = None
            self._give_back(request)
        if not kept:
            self._stop_reading_requests()
        self._next(request)

    # gateway.http.exchange.RelayWire

    def accepting(self) -> bool:
        return self._open()

    def answered(self, request: HttpRequest, kept: bool) -> None:
        """A relay's answer to `request` is over: as a task's end in `_serve`."""
        self._give_back(request)
        if not kept:
            self._stop_reading_requests()
        if self.write_paused and self.state is not ConnectionState.CLOSED:
            self._written = request  # a client not reading its answers gets no more of them
            return
        self._task = None
        self._next(request)

    def resume_writing(self) -> None:
        super().resume_writing()
        written, self._written = self._written, None
        if written is not None:
            self._task = None
            self._next(written)
        elif self._task is not None and not isinstance(self._task, asyncio.Task):
            self._task.drained()

    def _next(self, request: HttpRequest) -> None:
        if self.state is ConnectionState.CLOSED or self._transport is None:
            return
        if not self._open() or not request.keep_alive:
            self._stop_reading_requests()
            if request.refused:
                self._linger()
            else:
                self._transport.close()
            return
        self.last_active = self._loop.time()
        if self._queue:
            self._start(self._queue.popleft())
        elif self._request is not None:
            self._next_arriving(self._request)
        if self._reading_paused and len(self._queue) < _QUEUED_MAX:
            self._reading_paused = False
            self._transport.resume_reading()

    def _next_arriving(self, request: HttpRequest) -> None:
        """The request still arriving is next: its time to arrive starts now, and it gets
        the `100 Continue` it was waiting for."""
        request.started = self.last_active
        if request.expect and request.method and not request.size:
            request.expect = False
            self.write(_CONTINUE)

    # Upgrade: ignored (RFC 9110 §7.8), the request served over HTTP/1.1

    def _skip_upgrade(self, rest: bytes) -> None:
        """httptools stops at the head of a request asking to upgrade (`curl --http2` asks
        for h2c), so its body is taken by Content-Length here and a new parser reads what
        follows."""
        upgrading = self._upgrading
        if upgrading is None:
            return  # refused already
        request = upgrading.request
        if request.method == b"CONNECT":
            self._upgrading = None
            self._refuse(problem(405, "CONNECT is not supported"))
            return
        if any(name == b"transfer-encoding" for name, _ in request.headers):
            self._upgrading = None
            self._refuse(problem(400, "a chunked body with an Upgrade header is not supported"))
            return
        self._parser = httptools.HttpRequestParser(self)
        upgrading.left = int(request.length or b"0")  # llhttp checked it is a number
        rest = self._upgrade_body(rest)
        if rest and self._open():
            self.data_received(rest)

    def _upgrade_body(self, data: bytes) -> bytes:
        """Take the upgrading request's body from `data`; returns what follows it."""
        upgrading = self._upgrading
        assert upgrading is not None
        request = upgrading.request
        taken, rest = data[: upgrading.left], data[upgrading.left :]
        upgrading.left -= len(taken)
        if taken and not request.refused:
            request.size += len(taken)
            self._take(request, taken)
        if upgrading.left == 0:
            self._upgrading = None
            self._complete(request)
        return rest
