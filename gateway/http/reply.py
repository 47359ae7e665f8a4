"""What a worker answers us: one type, for an answer read whole or piece by piece.

A `Reply` is one call: the request bytes, then the answer's head and body as they arrive.
Whoever carries the call fills it (`on_head`, `on_piece`, `on_end`, `on_error`): a
connection of `gateway.http.connections` from httptools' callbacks, or
`gateway.http.upstream.HttpxUpstream` from an httpx answer. A streamed body is buffered
here until read; past `PAUSE_AT` unread bytes the connection stops reading from the worker
until the reader catches up, so a slow client slows its decode instead of filling the
gateway's memory.

A call is awaited through its `future`, or followed by a `Listener` instead: told at the
answer's head (streamed) or end (`whole`), at each piece of a streamed body and at its end
or error, from the connection's callbacks, so that an answer relayed by callbacks
(`gateway.serving.relay`) costs no future and no task.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

PAUSE_AT = 256 * 1024
"""Bytes of a streamed body buffered unread before reading from the worker pauses."""


class Carrier(Protocol):
    """What a call needs of the connection carrying it (`gateway.http.connections.Connection`)."""

    @property
    def paused(self) -> bool:
        """Reading from the worker is paused."""
        ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def abort(self) -> None:
        """Close at once: the answer will not be read to its end."""
        ...


class Listener(Protocol):
    """Follows a call instead of its future (`Reply.listener`)."""

    def replied(self, reply: Reply) -> None:
        """The answer's head arrived (streamed), or all of it (`whole`)."""
        ...

    def more(self, reply: Reply) -> None:
        """More of a streamed body arrived, or it ended (`reply.done`): `take` it."""
        ...

    def failed(self, reply: Reply, error: BaseException) -> None: ...


class Reply:
    """One call: its answer's status and headers, then its body as pieces or whole."""

    __slots__ = (
        "_buffered",
        "_error",
        "_loop",
        "_pieces",
        "_reader",
        "body",
        "connection",
        "data",
        "done",
        "future",
        "head_only",
        "headers",
        "listener",
        "received",
        "status",
        "task",
        "timeout",
        "whole",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        data: bytes,
        timeout: float | None,
        whole: bool,
        future: asyncio.Future[Reply] | None = None,
        listener: Listener | None = None,
    ) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = b""
        """The whole body, once a `whole` call's future has resolved."""
        # The pool's side.
        self.future = future
        """Resolves at the head (streamed) or at the end (`whole`) of the answer; dropped
        then, since its result is this object: kept, the pair would be a reference cycle
        left for the garbage collector, two per request."""
        self.listener = listener
        """Follows the call in place of `future`; dropped once the call is over."""
        self.data = data
        """The request as written."""
        self.timeout = timeout
        """The longest silence allowed while the answer is awaited."""
        self.whole = whole
        self.head_only = data.startswith(b"HEAD ")
        self.connection: Carrier | None = None
        """The connection carrying the call, until its answer ended."""
        self.task: asyncio.Task[None] | None = None
        """The task connecting for the call, or reading its answer from httpx; cancelled
        when the reply is closed."""
        self.received = False
        """Some of the answer arrived (a call that got nothing may be sent again)."""
        self.done = False
        # The reader's side.
        self._pieces: list[bytes] = []
        self._buffered = 0
        self._error: BaseException | None = None
        self._reader: asyncio.Future[bytes] | None = None
        self._loop = loop

    def header(self, name: bytes) -> bytes | None:
        """The value of header `name` (lowercase), or None."""
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    @property
    def media_type(self) -> bytes:
        return self.header(b"content-type") or b"application/json"

    def next(self) -> asyncio.Future[bytes]:
        """The body that arrived since the last call, at once when there is some, else the
        next piece as it arrives; b"" once the body has ended.

        Pieces that arrived together go out together: a decode's SSE events read in one
        system call are passed on in one write instead of one each, which costs less CPU.
        """
        future: asyncio.Future[bytes] = self._loop.create_future()
        if self._pieces or self.done or self._error is not None:
            self._take(future)
        else:
            self._reader = future
        return future

    def take(self) -> bytes:
        """What arrived of the body since the last read (b"" when nothing did)."""
        pieces = self._pieces
        if not pieces:
            return b""
        piece = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        self._buffered = 0
        connection = self.connection
        if connection is not None and connection.paused:
            connection.resume()
        return piece

    def _take(self, future: asyncio.Future[bytes]) -> None:
        if self._pieces:
            future.set_result(self.take())
        elif self._error is not None:
            future.set_exception(self._error)
        else:
            future.set_result(b"")

    async def read(self) -> bytes:
        """The rest of the body."""
        pieces = []
        while piece := await self.next():
            pieces.append(piece)
        return b"".join(pieces)

    async def aclose(self) -> None:
        """`close`, then until the task carrying the call has ended."""
        self.close()
        task = self.task
        if task is not None and not task.done():
            await asyncio.wait((task,))

    def close(self) -> None:
        """Done with this answer: its connection is closed unless the answer was complete."""
        self.done = True
        self.listener = None
        self._pieces.clear()
        if self.task is not None:
            self.task.cancel()
        if self.connection is not None:
            self.connection.abort()

    # The connection's side: what it has read.

    def on_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.received = True
        self.status, self.headers = status, headers
        if not self.whole:
            self._resolve()

    def on_piece(self, piece: bytes) -> None:
        if self.done:
            return
        self._pieces.append(piece)
        self._buffered += len(piece)
        if self.whole:
            return
        if self.listener is None:
            self._wake()
        if self._buffered > PAUSE_AT and self.connection is not None:
            self.connection.pause()

    def flush(self) -> None:
        """The connection has parsed what one read brought: a listener is told of the
        pieces it holds, once for all of them (one write to the client, not one each)."""
        if self._pieces and self.listener is not None and not self.whole:
            self.listener.more(self)

    def on_end(self) -> None:
        self.connection = None
        self.done = True
        if self.whole:
            self.body = b"".join(self._pieces)
            self._pieces.clear()
            self._buffered = 0
            self._resolve()
        listener, self.listener = self.listener, None
        if listener is not None and not self.whole:
            listener.more(self)
        self._wake()

    def on_error(self, error: BaseException) -> None:
        self.connection = None
        self._error = error
        listener, self.listener = self.listener, None
        if listener is not None:
            listener.failed(self, error)
            return
        future, self.future = self.future, None
        if future is not None and not future.done():
            future.set_exception(error)
        self._wake()

    def _wake(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None and not reader.done():
            self._take(reader)

    def _resolve(self) -> None:
        if self.listener is not None:
            self.listener.replied(self)
            return
        future, self.future = self.future, None
        if future is not None and not future.done():
            future.set_result(self)

    def settled(self, future: asyncio.Future[Reply]) -> None:
        """`future`'s done-callback: a cancelled call closes its connection."""
        if future.cancelled():
            self.close()
