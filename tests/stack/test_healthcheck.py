"""The containers' health-check command against a real HTTP server on a free port."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from globalkv.stack.healthcheck import main, problem
from tests.support.net import free_port


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 503)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the test output is the report."""


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def test_a_200_is_healthy(server: str) -> None:
    assert problem(f"{server}/health") is None
    assert main([f"{server}/health", f"{server}/health"]) == 0


def test_any_other_answer_or_no_answer_is_not(
    server: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert problem(f"{server}/readiness") == "HTTP 503"
    closed = f"http://127.0.0.1:{free_port()}/health"
    assert "Connection refused" in (problem(closed) or "")
    assert main([f"{server}/health", f"{server}/readiness"]) == 1
    assert f"{server}/readiness: HTTP 503" in capsys.readouterr().err


def test_without_urls_it_prints_its_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage" in capsys.readouterr().err
