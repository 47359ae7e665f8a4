"""Request ids from the headers a client sent, and the ids made when it sent none usable."""

from __future__ import annotations

import re

import pytest

from gateway.serving.edge import REQUEST_ID_MAX, Edge
from gateway.settings.edge import EdgeConfig

EDGE = Edge(EdgeConfig())


def test_the_first_configured_header_the_client_sent_names_the_request() -> None:
    picked = {b"x-trace-id": b"trace-1", b"x-correlation-id": b"corr-1"}
    assert EDGE.request_id("/generate", picked) == "corr-1"  # listed before x-trace-id


def test_any_visible_ascii_up_to_the_limit_is_an_id() -> None:
    every = bytes(range(0x21, 0x7F))
    for value in (every, b"x" * REQUEST_ID_MAX, b"!", b"~"):
        assert EDGE.request_id("/generate", {b"x-request-id": value}) == value.decode()


@pytest.mark.parametrize(
    "value",
    [
        b"",
        b"has space",
        b"tab\there",
        b"\xff\xfe",
        b"del\x7f",
        b"nul\x00",
        b"x" * (REQUEST_ID_MAX + 1),
    ],
)
def test_an_id_unfit_for_headers_and_logs_is_passed_over(value: bytes) -> None:
    assert EDGE.request_id("/generate", {b"x-request-id": value}).startswith("gnt-")
    picked = {b"x-request-id": value, b"request-id": b"fallback-2"}
    assert EDGE.request_id("/generate", picked) == "fallback-2"


@pytest.mark.parametrize(
    ("path", "prefix"),
    [("/v1/chat/completions", "chatcmpl-"), ("/v1/completions", "cmpl-"), ("/generate", "gnt-")],
)
def test_a_made_id_has_the_path_s_prefix_and_24_hex_digits(path: str, prefix: str) -> None:
    made = {EDGE.request_id(path, {}) for _ in range(100)}
    assert len(made) == 100
    assert all(re.fullmatch(re.escape(prefix) + "[0-9a-f]{24}", i) for i in made)
