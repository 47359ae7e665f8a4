"""How the gateway calls a worker: a two-method interface and its two implementations.

`fetch` gets a whole answer (the prefill's; a non-streamed decode's), `open` an answer
whose body is then read piece by piece as it arrives (a streamed decode's); both are a
`gateway.http.reply.Reply`. Both return awaitables that start the call at once (`extra`
headers follow the JSON content type: the vLLM legs' `X-Request-Id`); the legs turn them
into futures and race them, and cancelling one cancels the call. Errors are httpx's
exception types.

- `PooledUpstream` is the gateway's own: calls on `gateway.http.connections.ConnectionPool`,
  whose futures are resolved by the connections' protocol callbacks (no task per call);
  `extra` headers are written per call, never cached with the request's head (each call
  has its own request id or trace context). Its `relay` makes a call followed by a
  listener instead of a future (`gateway.legs.relayed`).
- `HttpxUpstream` goes through an `httpx.AsyncClient`, so tests drive dispatch, retries,
  breakers and cancellation with `httpx.MockTransport`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Protocol

import httpx

from gateway.http.connections import ConnectionPool
from gateway.http.reply import Listener, Reply

_HEADERS = ((b"Content-Type", b"application/json"), (b"Accept-Encoding", b"identity"))
_HTTPX_HEADERS = {"content-type": "application/json", "accept-encoding": "identity"}

Extra = tuple[tuple[bytes, bytes], ...]


class Upstream(Protocol):
    def fetch(
        self, url: str, body: bytes, timeout: float, extra: Extra = ()
    ) -> Awaitable[Reply]: ...

    def open(
        self, url: str, body: bytes, timeout: float, extra: Extra = ()
    ) -> Awaitable[Reply]: ...


class PooledUpstream:
    def __init__(self, pool: ConnectionPool) -> None:
        self._pool = pool

    def fetch(self, url: str, body: bytes, timeout: float, extra: Extra = ()) -> Awaitable[Reply]:
        return self._pool.request(
            b"POST", url, body, headers=_HEADERS, more=extra, timeout=timeout, whole=True
        )

    def open(self, url: str, body: bytes, timeout: float, extra: Extra = ()) -> Awaitable[Reply]:
        return self._pool.request(
            b"POST", url, body, headers=_HEADERS, more=extra, timeout=timeout, whole=False
        )

    def relay(
        self,
        url: str,
        body: bytes,
        timeout: float,
        extra: Extra,
        *,
        whole: bool,
        listener: Listener,
    ) -> Reply:
        """A call that `listener` follows (`gateway.http.reply.Listener`)."""
        return self._pool.call(
            b"POST",
            url,
            body,
            headers=_HEADERS,
            more=extra,
            timeout=timeout,
            whole=whole,
            listener=listener,
        )


def _httpx_headers(extra: Extra) -> dict[str, str]:
    if not extra:
        return _HTTPX_HEADERS
    return {**_HTTPX_HEADERS, **{k.decode(): v.decode("latin-1") for k, v in extra}}


async def _read(response: httpx.Response, reply: Reply) -> None:
    """`response`'s body into `reply` as it arrives, until it ends or the reply is closed."""
    try:
        async for piece in response.aiter_bytes():
            if piece:
                reply.on_piece(piece)
        reply.on_end()
    except httpx.HTTPError as exc:
        reply.on_error(exc)
    finally:
        await response.aclose()


class HttpxUpstream:
    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client

    async def fetch(self, url: str, body: bytes, timeout: float, extra: Extra = ()) -> Reply:
        response = await self._client.post(
            url, content=body, headers=_httpx_headers(extra), timeout=timeout
        )
        reply = Reply(asyncio.get_running_loop(), b"", timeout, whole=True)
        reply.on_head(response.status_code, response.headers.raw)
        reply.on_piece(response.content)
        reply.on_end()
        return reply

    async def open(self, url: str, body: bytes, timeout: float, extra: Extra = ()) -> Reply:
        request = self._client.build_request(
            "POST", url, content=body, headers=_httpx_headers(extra), timeout=timeout
        )
        response = await self._client.send(request, stream=True)
        reply = Reply(asyncio.get_running_loop(), b"", timeout, whole=False)
        reply.on_head(response.status_code, response.headers.raw)
        reply.task = asyncio.create_task(_read(response, reply))
        return reply
