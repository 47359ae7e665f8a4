"""How the dispatcher calls a worker: a two-method interface and its two implementations.

`fetch` gets a whole answer (the prefill's; a non-streamed decode's), `open` an answer
whose body is then read piece by piece as it arrives (a streamed decode's). Both return
awaitables that start the call at once (`extra` headers follow the JSON content type: the
vLLM legs' `X-Request-Id`); the dispatcher turns them into futures and races
them, and cancelling one cancels the call. Errors are httpx's exception types.

- `PooledUpstream` is the gateway's own: calls on `gateway.http.connections.ConnectionPool`,
  whose futures are resolved by the connections' protocol callbacks (no task per call).
- `HttpxUpstream` goes through an `httpx.AsyncClient`, so tests drive dispatch, retries,
  breakers and cancellation with `httpx.MockTransport`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from typing import Protocol

import httpx

from gateway.http.answer import Answer
from gateway.http.connections import ConnectionPool

_HEADERS = ((b"Content-Type", b"application/json"), (b"Accept-Encoding", b"identity"))
_HTTPX_HEADERS = {"content-type": "application/json", "accept-encoding": "identity"}


class Whole(Protocol):
    """An answer read to its end."""

    @property
    def status(self) -> int: ...

    @property
    def body(self) -> bytes: ...

    @property
    def media_type(self) -> bytes: ...


class Reply(Protocol):
    """An answer whose head has arrived; its body follows."""

    @property
    def status(self) -> int: ...

    def header(self, name: bytes) -> bytes | None:
        """The value of header `name` (lowercase), or None."""
        ...

    def next(self) -> Awaitable[bytes]:
        """The next piece of the body; b"" once it has ended."""
        ...

    def read(self) -> Awaitable[bytes]:
        """The rest of the body."""
        ...

    async def aclose(self) -> None:
        """Done with the answer; an unfinished one closes its connection."""
        ...


Extra = tuple[tuple[bytes, bytes], ...]


class Upstream(Protocol):
    def fetch(
        self, url: str, body: bytes, timeout: float, extra: Extra = ()
    ) -> Awaitable[Whole]: ...

    def open(
        self, url: str, body: bytes, timeout: float, extra: Extra = ()
    ) -> Awaitable[Reply]: ...


class PooledUpstream:
    def __init__(self, pool: ConnectionPool) -> None:
        self._pool = pool

    def fetch(self, url: str, body: bytes, timeout: float, extra: Extra = ()) -> Awaitable[Whole]:
        headers = _HEADERS + extra if extra else _HEADERS
        return self._pool.request(b"POST", url, body, headers=headers, timeout=timeout, whole=True)

    def open(self, url: str, body: bytes, timeout: float, extra: Extra = ()) -> Awaitable[Reply]:
        headers = _HEADERS + extra if extra else _HEADERS
        return self._pool.request(b"POST", url, body, headers=headers, timeout=timeout, whole=False)


def _httpx_headers(extra: Extra) -> dict[str, str]:
    if not extra:
        return _HTTPX_HEADERS
    return {**_HTTPX_HEADERS, **{k.decode(): v.decode("latin-1") for k, v in extra}}


class _HttpxReply:
    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self._pieces: AsyncIterator[bytes] = response.aiter_bytes()

    @property
    def status(self) -> int:
        return self._response.status_code

    def header(self, name: bytes) -> bytes | None:
        value = self._response.headers.get(name.decode())
        return None if value is None else value.encode()

    async def next(self) -> bytes:
        async for piece in self._pieces:
            if piece:
                return piece
        return b""

    async def read(self) -> bytes:
        pieces = []
        while piece := await self.next():
            pieces.append(piece)
        return b"".join(pieces)

    async def aclose(self) -> None:
        await self._response.aclose()


class HttpxUpstream:
    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client

    async def fetch(self, url: str, body: bytes, timeout: float, extra: Extra = ()) -> Whole:
        response = await self._client.post(
            url, content=body, headers=_httpx_headers(extra), timeout=timeout
        )
        media = response.headers.get("content-type", "application/json").encode()
        return Answer(response.status_code, response.content, media)

    async def open(self, url: str, body: bytes, timeout: float, extra: Extra = ()) -> Reply:
        request = self._client.build_request(
            "POST", url, content=body, headers=_httpx_headers(extra), timeout=timeout
        )
        return _HttpxReply(await self._client.send(request, stream=True))
