"""The indexer, lookup and pods commands: flags and environment into typed configuration."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from globalkv.cli import main, parse
from globalkv.commands.client import lookup_body, pod_rows, table
from globalkv.commands.indexer import config_from_args

POD = {"id": "p0", "block_size": 32, "kv_events": {"endpoint": "tcp://10.0.0.1:5557"}}
BOUND = {"id": "b0", "kv_events": {"mode": "bind", "topic": "kv@b0@m"}}


def test_indexer_flags_become_one_config() -> None:
    args = parse(
        [
            "indexer",
            "--port",
            "8101",
            "--block-size",
            "16",
            "--bind",
            "tcp://*:5557",
            "--bind",
            "tcp://*:5558",
            "--pod",
            json.dumps(POD),
            "--admin-token",
            "t",
            "--max-body-bytes",
            "65536",
        ],
        {},
    )
    config = config_from_args(args)
    assert config.api.max_body_bytes == 65536
    assert config.port == 8101
    assert config.ingest.bind == ["tcp://*:5557", "tcp://*:5558"]
    assert [p.id for p in config.pods] == ["p0"]
    assert config.api.admin_token == "t"
    assert config.api.insecure is False
    assert config.ingest.allow_endpoint_schemes == []
    assert config.redis_url is None


def test_the_doors_through_the_environment() -> None:
    env = {
        "GLOBALKV_INDEXER_INSECURE": "true",
        "GLOBALKV_INDEXER_ALLOW_ENDPOINT_SCHEME": "ipc,inproc",
    }
    ipc = {**POD, "kv_events": {"endpoint": "ipc:///run/engine.sock"}}
    config = config_from_args(parse(["indexer", "--pod", json.dumps(ipc)], env))
    assert config.api.insecure is True
    assert config.ingest.allow_endpoint_schemes == ["ipc", "inproc"]
    assert [p.id for p in config.pods] == ["p0"]


def test_pods_file_through_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "pods.json"
    path.write_text(json.dumps([POD, {**POD, "id": "p1"}]))
    env = {"GLOBALKV_INDEXER_PODS_FILE": str(path), "GLOBALKV_INDEXER_REDIS_URL": "redis://r/0"}
    config = config_from_args(parse(["indexer"], env))
    assert [p.id for p in config.pods] == ["p0", "p1"]
    assert config.redis_url == "redis://r/0"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["indexer", "--pod", "{"], "not JSON"),
        (["indexer", "--pod", json.dumps({**POD, "block_size": 24})], "not a multiple"),
        (["indexer", "--pod", json.dumps({"id": "p0"})], "kv_events"),
        (["indexer", "--pods-file", "/nonexistent/pods.json"], "pods-file"),
        (["indexer", "--bind", "5557"], "tcp://"),
        (["indexer", "--redis-url", "localhost"], "redis://"),
        (["indexer", "--block-size", "0"], "block_size"),
        (["indexer", "--max-body-bytes", "10"], "api.max_body_bytes"),
        (["indexer", "--pod", json.dumps(POD), "--pod", json.dumps(POD)], "given twice"),
        (
            ["indexer", "--pod", json.dumps({**POD, "kv_events": {"endpoint": "ipc:///x"}})],
            "--allow-endpoint-scheme ipc",
        ),
        (["indexer", "--admin-token", ""], "api.admin_token"),
        (
            ["indexer", "--pod", json.dumps(BOUND), "--pod", json.dumps({**BOUND, "id": "b1"})],
            "both name the topic",
        ),
    ],
)
def test_invalid_indexer_configuration(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config_from_args(parse(argv, {}))


def test_lookup_body() -> None:
    args = parse(["lookup", "--indexer", "http://x", "--model", "m", "--tokens", "1, 2,3"], {})
    assert lookup_body(args) == {"model": "m", "token_ids": [1, 2, 3]}
    args = parse(["lookup", "--indexer", "http://x", "--model", "m", "--text", "hi"], {})
    assert lookup_body(args) == {"model": "m", "text": "hi"}


def test_pod_rows_and_table() -> None:
    pods = [
        {
            "id": "p0",
            "model": "m",
            "role": "prefill",
            "kv_events": {"endpoint": "tcp://h:1"},
            "owner": "ix-1",
            "state": {
                "subscribed": True,
                "receiving": True,
                "sources": [{"dp_rank": 0, "last_seq": 7, "last_applied_at": 95.0, "resets": 1}],
            },
        },
        {"id": "p1", "model": "", "role": "prefill", "kv_events": {"topic": "kv@p1@m"}},
    ]
    rows = pod_rows(pods, now=100.0)
    assert rows == [
        ("p0", "m", "prefill", 0, "tcp://h:1", "ix-1", "yes", "yes", 7, "5.0s", 1, 0),
        ("p1", "-", "prefill", "-", "bind:kv@p1@m", "-", "no", "no", "-", "-", 0, 0),
    ]
    assert table(("A", "LONG"), [("xx", 1)]).splitlines() == ["A   LONG", "xx  1"]


class _Odd(BaseHTTPRequestHandler):
    """An indexer answering 200 with JSON of the wrong outline."""

    def _answer(self) -> None:
        body = json.dumps({"block_size": 4} if self.path == "/v1/lookup" else {"pods": [7]})
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(body.encode())

    do_GET = do_POST = _answer

    def log_message(self, format: str, *args: object) -> None:
        return None


@pytest.fixture
def odd_indexer() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Odd)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(5)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["lookup", "--model", "m", "--tokens", "1"], "not a lookup result"),
        (["pods"], "not a pod list"),
    ],
)
def test_an_unexpected_answer_is_reported_not_a_traceback(
    odd_indexer: str, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*argv, "--indexer", odd_indexer]) == 1
    assert message in capsys.readouterr().err


class _ListError(BaseHTTPRequestHandler):
    """Something in front of the indexer answering an error whose JSON is not an object."""

    def _answer(self) -> None:
        self.send_response(404)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(b'["not", "an", "object"]')

    do_GET = do_POST = _answer

    def log_message(self, format: str, *args: object) -> None:
        return None


@pytest.mark.parametrize("argv", [["lookup", "--model", "m", "--tokens", "1"], ["pods"]])
def test_an_error_whose_body_is_no_json_object_is_reported(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ListError)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert main([*argv, "--indexer", f"http://127.0.0.1:{server.server_address[1]}"]) == 1
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    err = capsys.readouterr().err
    assert f"globalkv {argv[0]}: " in err
    assert 'answered 404: ["not", "an", "object"]' in err


@pytest.mark.parametrize(
    ("indexer", "message"),
    [
        ("http://127.0.0.1:INDEX_PORT", "has an invalid port"),
        ("http://127.0.0.1:99999", "has an invalid port"),
        ("127.0.0.1:8100", "is not an http(s) URL with a host"),
        ("http://ix:1/\r\nx: y", "control characters"),
    ],
)
@pytest.mark.parametrize("argv", [["lookup", "--model", "m", "--text", "t"], ["pods"]])
def test_an_unusable_indexer_url_is_one_line_not_a_traceback(
    argv: list[str], indexer: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*argv, "--indexer", indexer]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
