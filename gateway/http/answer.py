"""What the gateway answers a client: one type, whole or streamed.

A whole answer is complete when it is handed over (a worker's passed on, or a refusal).
A stream is handed over once its first piece exists, since nothing before it commits the
client to this answer: `body` holds that piece and `rest` the others, read as they arrive.
Every error the gateway writes itself has one body, OpenAI's error object:
`{"error": {"message", "type", "param", "code"}}` — what OpenAI's clients read, and on
SGLang's `/generate` the `{"error": {"message"}}` SGLang answers, with more fields.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import httpx

Outcome = Literal["done", "upstream_error", "client_gone"]
"""How a stream ended: to its end, broken off upstream, or the client left (or could not be
written to)."""


class Rest(Protocol):
    """The pieces of a streamed answer after its first."""

    def next(self) -> Awaitable[bytes]:
        """The next piece; b"" once the stream has ended; `httpx.HTTPError` when it broke off."""
        ...

    async def close(self, outcome: Outcome) -> None:
        """The stream is over (always called once, whatever ended it)."""
        ...


class After:
    """`rest`, and `then(outcome)` once it has closed, whatever its close raised: what a
    layer above the one that made a stream does when it ends (its metrics, its span, the
    place it held)."""

    __slots__ = ("_rest", "_then")

    def __init__(self, rest: Rest, then: Callable[[Outcome], None]) -> None:
        self._rest = rest
        self._then = then

    def next(self) -> Awaitable[bytes]:
        return self._rest.next()

    async def close(self, outcome: Outcome) -> None:
        try:
            await self._rest.close(outcome)
        finally:
            self._then(outcome)


# Built per request: its own __init__, compiled where the module is (the dataclass gives
# eq and repr only; its generated __init__ runs interpreted): docs/gateway-design.md.
@dataclass(slots=True, init=False)
class Answer:
    """An answer to a client: whole when `rest` is None, else a stream whose first piece is
    `body`."""

    status: int
    body: bytes
    media_type: bytes
    headers: tuple[tuple[str, str], ...]
    """More head lines passed on from the worker (a stream's cache-control, request id)."""
    rest: Rest | None

    def __init__(
        self,
        status: int,
        body: bytes,
        media_type: bytes = b"application/json",
        headers: tuple[tuple[str, str], ...] = (),
        rest: Rest | None = None,
    ) -> None:
        self.status = status
        self.body = body
        self.media_type = media_type
        self.headers = headers
        self.rest = rest


async def pass_on(rest: Rest, send: Callable[[bytes], Awaitable[None]]) -> bool:
    """Each piece of `rest` to `send` as it arrives; True when the stream ended properly.

    However it ends, `rest` is closed with how: cancelled (the client left) or ended by an
    error of `send`, as "client_gone"; broken off upstream, as "upstream_error".
    """
    outcome: Outcome = "client_gone"
    error: BaseException | None = None
    try:
        while piece := await rest.next():
            await send(piece)
        outcome = "done"
    except httpx.HTTPError:
        outcome = "upstream_error"
    except BaseException as exc:  # closed first, then raised on: an await in a finally
        error = exc  # loses the exception in flight once mypyc compiles this
    await rest.close(outcome)
    if error is not None:
        raise error
    return outcome == "done"


def error_body(message: str, kind: str) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": None}}
    ).encode()


def problem(status: int, message: str, kind: str = "invalid_request_error") -> Answer:
    return Answer(status, error_body(message, kind))


def too_large(limit: int, flag: str = "--max-payload-size") -> Answer:
    """A body over `limit`, the setting of `flag`."""
    return problem(413, f"request body exceeds {flag} ({limit} bytes)")


def over_budget(total: int, flag: str = "--max-buffered-payload-size") -> Answer:
    """A body refused because the bodies the process holds already fill its total, the
    setting of `flag`."""
    message = (
        f"the request bodies this server holds fill its total, {flag} ({total} bytes); "
        "try again later"
    )
    return problem(503, message, "overloaded")
