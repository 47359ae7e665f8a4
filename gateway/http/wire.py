"""HTTP/1.1 on the wire for `gateway.http.server`: the parsed request, answers, the ASGI bridge.

The server's handler answers the paths it claims; every other request goes through
`serve_asgi` to the ASGI app with its body already read, so those routes keep their one
implementation. Nothing here knows what an answer means. The bridge speaks the ASGI HTTP
protocol (version 3.0, spec 2.3) as far as the app needs: one `http.request` message with
the whole body, then `http.disconnect` once the client has gone; the answer framed by its
Content-Length, else chunked (HTTP/1.0: ended by closing the connection).
"""

from __future__ import annotations

import http
import logging
from typing import Any, Protocol
from urllib.parse import unquote

from starlette.types import ASGIApp, Message

from gateway.http.answer import Answer, pass_on

log = logging.getLogger(__name__)

_REASONS = {status.value: status.phrase.encode() for status in http.HTTPStatus}
CLOSE = b"connection: close\r\n"
_KEEP_ALIVE = b"connection: keep-alive\r\n"
LAST_CHUNK = b"0\r\n\r\n"


def status_line(status: int) -> bytes:
    return b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b""))


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def connection_header(keep_alive: bool, version: str = "1.1") -> bytes:
    """The Connection header of an answer: close, or keep-alive where HTTP/1.0 needs it said."""
    if not keep_alive:
        return CLOSE
    return _KEEP_ALIVE if version == "1.0" else b""


def answer_bytes(answer: Answer, connection: bytes, extra: bytes = b"") -> bytes:
    """`answer` framed by its length, with its own header lines; `extra`: more header
    lines, each ending in CRLF."""
    own = b"".join([b"%s: %s\r\n" % (k.encode(), v.encode("latin-1")) for k, v in answer.headers])
    head = b"%scontent-type: %s\r\ncontent-length: %d\r\n%s%s%s\r\n" % (
        status_line(answer.status),
        answer.media_type,
        len(answer.body),
        own,
        extra,
        connection,
    )
    return head + answer.body


def stream_start(answer: Answer, chunked: bool, keep_alive: bool) -> bytes:
    """A streamed answer's head and first piece (`answer.body`): chunked, or for HTTP/1.0
    ended by the connection's close."""
    head = [status_line(answer.status), b"content-type: %s\r\n" % answer.media_type]
    head += [b"%s: %s\r\n" % (k.encode(), v.encode("latin-1")) for k, v in answer.headers]
    if chunked:
        head.append(b"transfer-encoding: chunked\r\n")
    head.append(connection_header(keep_alive and chunked) + b"\r\n")
    if answer.body:
        head.append(chunk(answer.body) if chunked else answer.body)
    return b"".join(head)


class HttpRequest:
    """One request as httptools parsed it, its body read whole."""

    __slots__ = (
        "authorization",
        "body",
        "expect",
        "head_size",
        "headers",
        "held",
        "keep_alive",
        "length",
        "method",
        "path",
        "query",
        "refused",
        "route",
        "size",
        "started",
        "url",
        "version",
    )

    def __init__(self, started: float) -> None:
        self.started = started
        """Loop time of its first byte (or of when it became next in line)."""
        self.head_size = 0
        """Bytes of its head received after the chunk it began in (see client_connection)."""
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        """Names in lowercase, as ASGI wants them."""
        self.body: list[bytes] = []
        self.size = 0
        self.held = 0
        """Bytes it holds of the server's body budget, given back once when it is over."""
        self.authorization: bytes | None = None
        """The Authorization header, as sent (the API key's check reads it)."""
        self.length: bytes | None = None
        """The Content-Length header, as sent."""
        self.expect = False
        """`Expect: 100-continue` was sent."""
        self.method = b""
        """b"" until the head is complete."""
        self.path = b""
        self.query = b""
        self.version = "1.1"
        self.keep_alive = True
        self.route: str | None = None
        """The path, for a POST to a path the server's handler answers."""
        self.refused = 0
        """The status it is refused with before it was read whole, its body dropped and the
        connection closed after: 413 over the per-request limit, 503 over the server's body
        budget; 0 while it is not."""

    def add_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        self.headers.append((name, value))
        if name == b"authorization":
            self.authorization = value
        elif name == b"content-length":
            self.length = value
        elif name == b"expect":
            self.expect = value.lower() == b"100-continue"

    def head_complete(self, method: bytes, version: str, keep_alive: bool) -> None:
        self.method, self.version, self.keep_alive = method, version, keep_alive
        self.path, _, self.query = self.url.partition(b"?")


class Wire(Protocol):
    """What writing an answer needs of a connection."""

    write_paused: bool
    """The transport's buffer is full: `drain` before writing more."""

    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None:
        """Until the client has taken what was written (flow control)."""
        ...

    async def disconnected(self) -> None:
        """Until the client has gone."""
        ...


async def write_stream(wire: Wire, answer: Answer, *, version: str, keep_alive: bool) -> bool:
    """A streamed answer: head and first piece in one write, then each piece as the worker
    sends it. True when the body ended properly (chunked), so the connection may be kept;
    HTTP/1.0 has no chunked encoding, and there the close ends the body."""
    rest = answer.rest
    assert rest is not None
    chunked = version != "1.0"
    wire.write(stream_start(answer, chunked, keep_alive))

    async def piece(data: bytes) -> None:
        wire.write(chunk(data) if chunked else data)
        if wire.write_paused:
            await wire.drain()

    if await pass_on(rest, piece) and chunked:
        wire.write(LAST_CHUNK)
        return True
    return False


async def serve_asgi(
    app: ASGIApp, wire: Wire, request: HttpRequest, *, keep_alive: bool, client: Any, server: Any
) -> bool:
    """Answer `request` through `app`; True when the connection may serve another request."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": request.version,
        "server": server,
        "client": client,
        "scheme": "http",
        "method": request.method.decode("ascii"),
        "root_path": "",
        "path": unquote(request.path.decode("latin-1")),
        "raw_path": request.path,
        "query_string": request.query,
        "headers": request.headers,
    }
    body: bytes | None = b"".join(request.body)
    request.body.clear()  # held once, not twice, while it is served
    bodyless = request.method == b"HEAD"
    state = {"started": False, "chunked": False, "complete": False, "keep": keep_alive}

    async def receive() -> Message:
        nonlocal body
        if body is not None:
            message: Message = {"type": "http.request", "body": body, "more_body": False}
            body = None
            return message
        await wire.disconnected()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            status = message["status"]
            headers = message.get("headers", [])
            lines = [
                status_line(status),
                *(name + b": " + value + b"\r\n" for name, value in headers),
            ]
            sized = any(name.lower() == b"content-length" for name, _ in headers)
            if not sized and not bodyless and status not in (204, 304):
                if request.version == "1.0":
                    state["keep"] = False  # the close ends the body
                else:
                    state["chunked"] = True
                    lines.append(b"transfer-encoding: chunked\r\n")
            lines.append(connection_header(state["keep"], request.version) + b"\r\n")
            wire.write(b"".join(lines))
            state["started"] = True
        elif message["type"] == "http.response.body" and not state["complete"]:
            data = b"" if bodyless else message.get("body", b"")
            more = message.get("more_body", False)
            if state["chunked"]:
                data = (chunk(data) if data else b"") + (b"" if more else LAST_CHUNK)
            wire.write(data)
            state["complete"] = not more
            await wire.drain()

    try:
        await app(scope, receive, send)
    except Exception:
        log.exception("error serving %s %s", scope["method"], scope["path"])
    if not state["complete"] and not state["started"]:
        message = "the app sent no answer"
        wire.write(answer_bytes(Answer(500, message.encode(), b"text/plain"), CLOSE))
    return state["complete"] and state["keep"]
