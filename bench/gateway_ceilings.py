"""Ceilings for `bench.gateway`: what a Python router on one core could reach at best.

    python -m bench.gateway_ceilings {asgi,raw,proxy} --pd-disaggregation --port P \\
        --prefill URL PORT … --decode URL … [other sglang-router flags, ignored]

Each mode takes sglang-router's flags, so `bench.gateway --ceilings` starts it like a
router, pinned to the same core, measured in the same interleaved runs:
- `asgi`: uvicorn (uvloop, httptools) with a bare ASGI app that answers every POST at
  once, with the mocks' answer shapes (one JSON body, or nine SSE chunks for a streamed
  request). The ceiling of any design that keeps uvicorn as the server.
- `raw`: an `asyncio.Protocol` server with the httptools parser answering the same
  prebuilt bytes. The ceiling of the server side alone.
- `proxy`: that server doing the router's work with nothing else: the body parsed
  (orjson), bootstrap fields injected, prefill and decode called at once (round-robin,
  pooled keep-alive connections, callbacks only: no task per request), the decode's
  answer passed through as it arrives. The ceiling of a Python PD router.

These are measuring instruments, not routers: no retries, no timeouts, no validation.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from collections.abc import Callable, Sequence
from typing import Any, cast
from urllib.parse import urlsplit

import httptools
import orjson

from bench.gateway_mocks import ANSWER, STREAM

ANSWER_BODY = ANSWER.partition(b"\r\n\r\n")[2]
SSE_EVENTS = [
    b"data: " + orjson.dumps({"text": "x" * (i + 1), "index": 0}) + b"\n\n" for i in range(8)
] + [b"data: [DONE]\n\n"]


def streamed(body: bytes) -> bool:
    return b'"stream": true' in body or b'"stream":true' in body


async def asgi_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    body = b""
    more = True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    if not streamed(body):
        headers = [(b"content-type", b"application/json")]
        headers.append((b"content-length", str(len(ANSWER_BODY)).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": ANSWER_BODY})
        return
    headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    for event in SSE_EVENTS:
        await send({"type": "http.response.body", "body": event, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


class _Inbound(asyncio.Protocol):
    """One client connection: requests parsed by httptools, answered by `respond`."""

    def __init__(self, respond: Callable[[_Inbound, bytes], None]) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.respond = respond
        self.body: list[bytes] = []
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_message_begin(self) -> None:
        self.body = []

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.respond(self, b"".join(self.body))

    def write(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)


def _answer_at_once(inbound: _Inbound, body: bytes) -> None:
    inbound.write(STREAM if streamed(body) else ANSWER)


class _Upstream(asyncio.Protocol):
    """A keep-alive connection to one worker; `sink` gets the answer's pieces."""

    def __init__(self, idle: list[_Upstream]) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.idle = idle
        self.transport: asyncio.Transport | None = None
        self.sink: _Relay | None = None
        self.head: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_header(self, name: bytes, value: bytes) -> None:
        lowered = name.lower()
        if lowered in (b"content-type", b"cache-control"):
            self.head.append(lowered + b": " + value + b"\r\n")

    def on_headers_complete(self) -> None:
        if self.sink is not None:
            self.sink.head(self.parser.get_status_code(), self.head)
        self.head = []

    def on_body(self, body: bytes) -> None:
        if self.sink is not None:
            self.sink.piece(body)

    def on_message_complete(self) -> None:
        sink, self.sink = self.sink, None
        self.idle.append(self)
        if sink is not None:
            sink.end()


class _Relay:
    """The decode's answer on its way to the client: whole, or chunk by chunk."""

    def __init__(self, inbound: _Inbound, streamed: bool) -> None:
        self.inbound = inbound
        self.streamed = streamed
        self.pieces: list[bytes] = []
        self.status = 200
        self.headers: list[bytes] = []

    def head(self, status: int, headers: list[bytes]) -> None:
        self.status, self.headers = status, headers
        if self.streamed:
            start = b"HTTP/1.1 %d OK\r\n%stransfer-encoding: chunked\r\n\r\n"
            self.inbound.write(start % (status, b"".join(headers)))

    def piece(self, data: bytes) -> None:
        if self.streamed:
            self.inbound.write(b"%x\r\n%s\r\n" % (len(data), data))
        else:
            self.pieces.append(data)

    def end(self) -> None:
        if self.streamed:
            self.inbound.write(b"0\r\n\r\n")
            return
        body = b"".join(self.pieces)
        head = b"HTTP/1.1 %d OK\r\n%scontent-length: %d\r\n\r\n"
        self.inbound.write(head % (self.status, b"".join(self.headers), len(body)) + body)


class _Worker:
    def __init__(self, url: str, bootstrap_port: int | None) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.bootstrap_port = bootstrap_port
        self.idle: list[_Upstream] = []
        self.headers = b"host: %s:%d\r\ncontent-type: application/json\r\n" % (
            self.host.encode(),
            self.port,
        )

    async def connect(self) -> _Upstream:
        loop = asyncio.get_running_loop()
        _, upstream = await loop.create_connection(
            lambda: _Upstream(self.idle), self.host, self.port
        )
        return upstream

    def send(self, path: bytes, payload: bytes, sink: _Relay | None) -> None:
        head = b"POST " + path + b" HTTP/1.1\r\n" + self.headers
        data = head + b"content-length: %d\r\n\r\n" % len(payload) + payload
        if self.idle:
            upstream = self.idle.pop()
            upstream.sink = sink
            assert upstream.transport is not None
            upstream.transport.write(data)
            return
        task = asyncio.get_running_loop().create_task(self.connect())

        def connected(done: asyncio.Task[_Upstream]) -> None:
            upstream = done.result()
            upstream.sink = sink
            assert upstream.transport is not None
            upstream.transport.write(data)

        task.add_done_callback(connected)


class _Proxy:
    def __init__(self, prefills: list[_Worker], decodes: list[_Worker]) -> None:
        self.prefills, self.decodes = prefills, decodes
        self.turn = 0
        self.rooms = random.Random()

    def __call__(self, inbound: _Inbound, body: bytes) -> None:
        request = orjson.loads(body)
        self.turn += 1
        prefill = self.prefills[self.turn % len(self.prefills)]
        decode = self.decodes[self.turn % len(self.decodes)]
        request["bootstrap_host"] = prefill.host
        request["bootstrap_port"] = prefill.bootstrap_port
        request["bootstrap_room"] = self.rooms.randint(1, 2**63 - 1)
        payload = orjson.dumps(request)
        prefill.send(b"/generate", payload, None)
        decode.send(b"/generate", payload, _Relay(inbound, request.get("stream") is True))


async def _serve(mode: str, args: argparse.Namespace) -> None:
    if mode == "asgi":
        import uvicorn

        config = uvicorn.Config(
            asgi_app,
            host=args.host,
            port=args.port,
            loop="uvloop",
            http="httptools",
            log_level="warning",
            access_log=False,
            lifespan="off",
        )
        await uvicorn.Server(config).serve()
        return
    respond: Callable[[_Inbound, bytes], None] = _answer_at_once
    if mode == "proxy":
        prefills = [_Worker(p[0], int(p[1]) if len(p) > 1 else None) for p in args.prefill]
        respond = _Proxy(prefills, [_Worker(d[0], None) for d in args.decode])
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Inbound(respond), args.host, args.port, backlog=1024)
    await server.serve_forever()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway_ceilings", description=__doc__)
    parser.add_argument("mode", choices=["asgi", "raw", "proxy"])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", nargs="+", action="append", default=[])
    parser.add_argument("--decode", nargs=1, action="append", default=[])
    args, _ = parser.parse_known_args(argv)
    import uvloop

    uvloop.run(_serve(args.mode, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
