"""Driving an ASGI app by hand, for what httpx's ASGITransport cannot show: a client that
leaves before its answer (ASGITransport only reports a disconnect once the answer is done).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

Message = dict[str, Any]
App = Callable[[dict[str, Any], Any, Any], Coroutine[Any, Any, None]]


class Exchange:
    """One request: the body arrives in `chunks` (all of it unless `complete` is False),
    then the client stays until `leave()`."""

    def __init__(
        self, method: str, path: str, chunks: list[bytes], *, complete: bool = True
    ) -> None:
        self.scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "root_path": "",
            "query_string": b"",
            "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 50000),
            "server": ("127.0.0.1", 8000),
        }
        self._body = [
            {
                "type": "http.request",
                "body": chunk,
                "more_body": i + 1 < len(chunks) or not complete,
            }
            for i, chunk in enumerate(chunks)
        ]
        self._gone = asyncio.Event()
        self.sent: list[Message] = []

    def leave(self) -> None:
        self._gone.set()

    async def receive(self) -> Message:
        if self._body:
            return self._body.pop(0)
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.sent.append(message)

    async def run(self, app: App) -> None:
        await app(self.scope, self.receive, self.send)

    @property
    def status(self) -> int | None:
        starts = [m["status"] for m in self.sent if m["type"] == "http.response.start"]
        return starts[0] if starts else None

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")
