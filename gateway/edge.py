"""The gateway's client edge besides routing: request ids and CORS (`--request-id-headers`,
`--cors-allowed-origins`), with sglang-router's semantics where it has them.

Request ids: the first of the configured request headers that the client sent names the
request (sglang-router's default list: `x-request-id`, `x-correlation-id`, `x-trace-id`,
`request-id`); without one, an id is made in OpenAI's shapes (`chatcmpl-…`, `cmpl-…`,
and `gnt-…` for `/generate`, as sglang-router makes them). Every answer carries it as
`x-request-id`, and the workers receive it as `X-Request-Id`, so one id follows a request
through the gateway's, the prefill's and the decode's logs. A client's id that is not a
short run of visible ASCII is replaced by a made one rather than copied into headers and
logs.

CORS: with `--cors-allowed-origins`, answers to an allowed `Origin` carry
`Access-Control-Allow-Origin` (`*` when every origin is allowed) and expose `x-request-id`,
and preflight `OPTIONS` requests are answered for every path (Starlette's middleware, in
front of the app; the server hands it `OPTIONS` on the inference paths too). Without the
flag no CORS header is sent, so browsers keep their same-origin rule: sglang-router allows
every origin when the list is empty, which would let any web page a user visits call a
gateway on their network.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from random import Random

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.config import EdgeConfig

Headers = Sequence[tuple[bytes, bytes]]

REQUEST_ID_MAX = 128
_ID_CHARS = string.ascii_letters + string.digits
_PREFIXES = (("/chat/completions", "chatcmpl-"), ("/completions", "cmpl-"), ("/generate", "gnt-"))


class Edge:
    def __init__(self, config: EdgeConfig) -> None:
        self._names = [name.encode() for name in config.request_id_headers]
        self._origins = set(config.cors_allowed_origins)
        self._any_origin = "*" in self._origins
        self._ids = Random()
        """Made ids: unique is all they need to be, so no system call per id."""

    def request_id(self, path: str, headers: Headers) -> str:
        """The client's id for this request, by the configured headers, else a new one."""
        for name in self._names:
            for key, value in headers:
                if key == name and _usable(value):
                    return value.decode("ascii")
        prefix = next((p for part, p in _PREFIXES if part in path), "req-")
        return prefix + "".join(self._ids.choices(_ID_CHARS, k=24))

    def answer_headers(self, request_id: str, headers: Headers) -> tuple[tuple[str, str], ...]:
        """The head lines an inference answer gets: its id, and CORS for an allowed origin."""
        lines = [("x-request-id", request_id)]
        if not self._origins:
            return tuple(lines)
        origin = next((value for key, value in headers if key == b"origin"), None)
        if origin is None:
            return tuple(lines)
        text = origin.decode("latin-1")
        if self._any_origin:
            lines.append(("access-control-allow-origin", "*"))
        elif text in self._origins:
            lines += [("access-control-allow-origin", text), ("vary", "Origin")]
        else:
            return tuple(lines)
        lines.append(("access-control-expose-headers", "x-request-id"))
        return tuple(lines)

    def wrap(self, app: ASGIApp) -> ASGIApp:
        """`app` behind the same edge: ids on its answers, CORS and preflights when set."""
        wrapped: ASGIApp = _RequestIds(app, self)
        if self._origins:
            wrapped = CORSMiddleware(
                wrapped,
                allow_origins=sorted(self._origins),
                allow_methods=["*"],
                allow_headers=["*"],
                expose_headers=["x-request-id"],
            )
        return wrapped


def _usable(value: bytes) -> bool:
    return 0 < len(value) <= REQUEST_ID_MAX and all(0x21 <= byte <= 0x7E for byte in value)


class _RequestIds:
    """An ASGI app's answers with the request's `x-request-id`."""

    def __init__(self, app: ASGIApp, edge: Edge) -> None:
        self._app = app
        self._edge = edge

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        request_id = self._edge.request_id(scope["path"], scope["headers"]).encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0] != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self._app(scope, receive, send_with_id)
