"""Idle client connections against a gateway whose open-files limit is low: a real gateway
process (`ulimit -n 64`) in front of workers served from this process.

Without a cap the idle connections take every file descriptor; a call to a worker then
cannot open a connection (EMFILE). That is the gateway's shortage, not the worker's: the
client is told so with a 503, and no worker's circuit, health or last error is touched. With
the default cap (half the limit) idle connections make room for new ones and traffic goes on.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from tests.support.net import free_port, wait_for
from tests.support.procs import Proc

pytestmark = pytest.mark.integration

LIMIT = 64
GENERATE = b'POST /generate HTTP/1.1\r\nhost: gw\r\ncontent-length: 20\r\n\r\n{"input_ids": [1,2]}'
WORKERS = b"GET /workers HTTP/1.1\r\nhost: gw\r\n\r\n"


class _Worker(BaseHTTPRequestHandler):
    """Answers and closes each connection (HTTP/1.0), so every call opens a new one."""

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._answer(200 if self.path in ("/health", "/server_info") else 404, b"{}")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        self._answer(200, b'{"text": "ok"}')

    def log_message(self, format: str, *args: Any) -> None:
        return None


@pytest.fixture
def workers() -> Iterator[tuple[str, str]]:
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), _Worker) for _ in range(2)]
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
    for thread in threads:
        thread.start()
    try:
        prefill, decode = (f"http://127.0.0.1:{s.server_address[1]}" for s in servers)
        yield prefill, decode
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


@contextlib.contextmanager
def gateway(prefill: str, decode: str, *flags: str) -> Iterator[int]:
    port = free_port()
    argv = ["gateway", "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", "0"]
    argv += ["--prefill", prefill, "none", "--decode", decode, *flags]
    argv += ["--worker-startup-check-interval", "0.1", "--health-check-interval-secs", "0.2"]
    limited = ["sh", "-c", f'ulimit -n {LIMIT} && exec "$0" "$@"', sys.executable]
    proc = Proc([*limited, "-m", "globalkv", *argv], name="gateway")
    try:
        proc.wait_http(f"http://127.0.0.1:{port}/readiness")
        yield port
    finally:
        proc.stop()


def _ask(sock: socket.socket, request: bytes) -> tuple[int, Any]:
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    fields = dict(line.lower().partition(b": ")[::2] for line in head.split(b"\r\n")[1:])
    length = int(fields[b"content-length"])
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split(b" ")[1]), json.loads(body)


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.settimeout(10)
    return sock


def test_out_of_file_descriptors_is_the_gateways_503_and_no_workers_fault(
    workers: tuple[str, str],
) -> None:
    with gateway(*workers, "--max-client-connections", "1000") as port:
        active = _connect(port)
        idle = [_connect(port) for _ in range(LIMIT)]
        answers: list[tuple[int, Any]] = []

        def refused() -> bool:  # until the gateway has accepted enough of them
            answers.append(_ask(active, GENERATE))
            return answers[-1][0] != 200

        wait_for(refused, timeout=10, what="the gateway out of file descriptors")
        status, body = answers[-1]
        assert status == 503, body
        message = body["error"]["message"]
        assert "out of its own resources" in message
        assert "EMFILE" in message
        assert f"open-files limit is {LIMIT}" in message
        status, listing = _ask(active, WORKERS)
        for worker in listing["workers"]:
            assert worker["status"] == "serving", worker
            assert (worker["circuit"], worker["consecutive_failures"]) == ("closed", 0)
            assert worker["last_error"] is None
        for sock in idle:
            sock.close()

        def answered() -> bool:
            status, _ = _ask(active, GENERATE)
            return status == 200

        wait_for(answered, timeout=10, what="an answer once the idle clients left")
        active.close()


def test_with_the_default_cap_idle_connections_make_room_and_traffic_goes_on(
    workers: tuple[str, str],
) -> None:
    with gateway(*workers) as port:
        idle = [_connect(port) for _ in range(LIMIT)]
        try:
            response = httpx.post(f"http://127.0.0.1:{port}/generate", json={"input_ids": [1]})
            assert response.status_code == 200, response.text
            listing = httpx.get(f"http://127.0.0.1:{port}/workers").json()["workers"]
            assert all(w["status"] == "serving" for w in listing), listing
        finally:
            for sock in idle:
                sock.close()
