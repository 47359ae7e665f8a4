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

import functools
from collections.abc import Mapping, Sequence
from random import Random

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.settings.edge import EdgeConfig

Headers = Sequence[tuple[bytes, bytes]]
Picked = Mapping[bytes, bytes]
"""The request headers a reader asked for, by name in lowercase (a repeated one by its last
value)."""

REQUEST_ID_MAX = 128
_PREFIXES = (("/chat/completions", "chatcmpl-"), ("/completions", "cmpl-"), ("/generate", "gnt-"))


class Edge:
    def __init__(self, config: EdgeConfig) -> None:
        self.header_names = tuple(name.encode() for name in config.request_id_headers)
        """The request headers that may name a request, in the order they are read."""
        self._origins = set(config.cors_allowed_origins)
        self._any_origin = "*" in self._origins
        self._ids = Random()
        """Made ids: unique is all they need to be, so no system call per id."""

    def request_id(self, path: str, picked: Picked) -> str:
        """The client's id for this request, by the first of `header_names` that it sent
        usable (`picked` holds them), else a new one: 24 hex digits after the path's
        prefix."""
        if picked:
            for name in self.header_names:
                value = picked.get(name)
                if value is not None and _usable(value):
                    return value.decode("ascii")
        return _prefix(path) + self._ids.getrandbits(96).to_bytes(12, "big").hex()

    def answer_headers(self, request_id: str, origin: bytes | None) -> tuple[tuple[str, str], ...]:
        """The head lines an inference answer gets: its id, and CORS for an allowed
        `origin` (the request's `Origin` header)."""
        lines = [("x-request-id", request_id)]
        if not self._origins or origin is None:
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


@functools.cache
def _prefix(path: str) -> str:
    """The made id's prefix for one of the inference paths (a loop, not a generator: a
    generator object per id cost 4x the loop, timeit)."""
    for part, prefix in _PREFIXES:
        if part in path:
            return prefix
    return "req-"


_VISIBLE = bytes(range(0x21, 0x7F))
"""What an id may be made of: visible ASCII, no space (it goes into head lines and logs)."""


def _usable(value: bytes) -> bool:
    # Deleting the visible bytes leaves the others, in one C call: checking each byte in
    # Python was most of what a client's own id cost its request (docs/benchmarks.md,
    # "What each feature costs a request").
    return 0 < len(value) <= REQUEST_ID_MAX and not value.translate(None, _VISIBLE)


class _RequestIds:
    """An ASGI app's answers with the request's `x-request-id`."""

    def __init__(self, app: ASGIApp, edge: Edge) -> None:
        self._app = app
        self._edge = edge

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        names = self._edge.header_names
        picked = {name: value for name, value in scope["headers"] if name in names}
        request_id = self._edge.request_id(scope["path"], picked).encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0] != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self._app(scope, receive, send_with_id)
