from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cli import build_settings
from bench.replay.config import ReplaySettings
from bench.replay.sweep import Sweep
from bench.replay.trace import TraceRequest, conversation
from globalkv.cli import main, parse
from tests.bench.traces import row, write_trace

REQUIRED = {"hit_rate", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "throughput_tok_s"}


def _trace(tmp_path: Path) -> Path:
    rows = [row(i * 500, 13 + i % 3, [i % 3, 10 + i % 4, 20 + i, 30 + i]) for i in range(24)]
    return write_trace(tmp_path / "tiny.jsonl", rows)


def _settings(*flags: str) -> tuple[ReplaySettings, Sweep | None]:
    return build_settings(parse(["bench", "replay", "--trace", "t.jsonl", *flags], {}))


def test_flags_become_typed_settings() -> None:
    settings, sweep = _settings(
        "--pods",
        "4",
        "--capacity-blocks",
        "9",
        "--prefill-overhead-ms",
        "2",
        "--kv-transfer-tokens-per-s",
        "none",
        "--prefix-queued-weight",
        "0.25",
        "--cache-threshold",
        "0.5",
        "--policies",
        "prefix,random",
    )
    assert sweep is None
    assert settings.cluster.pods == 4
    assert settings.cluster.capacity_blocks == 9
    assert settings.cluster.prefill_overhead_s == 0.002
    assert settings.cluster.kv_transfer_tokens_per_s is None
    assert settings.prefix.queued_weight == 0.25
    assert settings.cache_aware.cache_threshold == 0.5
    assert settings.policies == ("prefix", "random")


def test_live_mode_drops_what_the_engines_cannot_emulate_and_caps_outputs() -> None:
    settings, _ = _settings("--mode", "live")
    assert settings.cluster.kv_transfer_tokens_per_s is None
    assert settings.max_output_tokens == 16
    with pytest.raises(ValueError, match="no attention term"):
        _settings("--mode", "live", "--attention-tokens", "52000")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--policies", "prefix,nope"], "unknown policies"),
        (["--policies", "prefix,prefix"], "listed twice"),
        (["--pods", "0"], "cluster.pods"),
        (["--decode-policy", "prefix"], "reads prefill caches"),
        (["--sweep", "colour=1,2"], "expected NAME=V1,V2"),
        (["--sweep", "event-delay-s="], "gives no values"),
        (["--sweep", "utilisation=0.5,lots"], "'lots' is not a valid value"),
        (["--sweep", "utilisation=0.5,-1"], "utilisation"),
        (["--prefix-pending-grace-secs", "-2"], "pending_grace_secs"),
        (["--sweep", "prefix-pending-grace-secs=off,-1"], "pending_grace_secs"),
    ],
)
def test_bad_flags_are_refused_by_check_config(flags: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _settings(*flags)


def test_the_pending_grace_is_seconds_or_off_never_infinite(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _settings("--prefix-pending-grace-secs", "off")[0].prefix.pending_grace_secs is None
    assert _settings("--prefix-pending-grace-secs", "3")[0].prefix.pending_grace_secs == 3.0
    with pytest.raises(SystemExit):
        _settings("--prefix-pending-grace-secs", "inf")
    assert "give a finite number, or 'off'" in capsys.readouterr().err


def test_check_mode_validates_without_running(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--check", "bench", "replay", "--trace", "absent.jsonl"]) == 0
    assert main(["--check", "bench", "replay", "--trace", "t", "--pods", "-1"]) == 2
    assert "cluster.pods" in capsys.readouterr().err


def test_a_replay_writes_json_markdown_and_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out" / "result.json"
    argv = [
        "bench",
        "replay",
        "--trace",
        str(_trace(tmp_path)),
        "--pods",
        "2",
        "--capacity-blocks",
        "6",
        "--prefill-tokens-per-s",
        "20",
        "--quiet",
        "--policies",
        "prefix,cache_aware,least_load,random",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert set(doc["policies"]) == {"prefix", "cache_aware", "least_load", "random"}
    for summary in doc["policies"].values():
        assert set(summary) >= REQUIRED
        assert summary["served"] == 24
    assert doc["cluster"]["capacity_blocks"] == 6
    assert doc["settings"]["cluster"]["pods"] == 2
    assert doc["trace"]["requests"] == 24
    assert 0 < doc["oracle"]["pooled_lru"] <= doc["oracle"]["belady"] <= doc["oracle"]["unlimited"]
    table = (tmp_path / "out" / "result.md").read_text()
    assert "| policy | KV hit rate (tokens) | TTFT mean (s) | p50 | p90 | p99 |" in table
    assert "oracle: Belady/MIN, pooled capacity" in table
    assert "mean TTFT random / prefix" in table
    assert table in capsys.readouterr().out
    for png in ("result-ttft-cdf.png", "result-hit-rate.png"):
        assert (tmp_path / "out" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_sweep_replays_every_value_and_plots_them(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    argv = [
        "bench",
        "replay",
        "--trace",
        str(_trace(tmp_path)),
        "--pods",
        "2",
        "--quiet",
        "--policies",
        "prefix",
        "--sweep",
        "capacity-blocks=2,8",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    sweep = json.loads(out.read_text())["sweep"]
    assert sweep["parameter"] == "capacity-blocks"
    assert [p["value"] for p in sweep["points"]] == ["2", "8"]
    assert [p["cluster"]["capacity_blocks"] for p in sweep["points"]] == [2, 8]
    small, large = (p["policies"]["prefix"]["hit_rate"] for p in sweep["points"])
    assert small <= large
    assert (tmp_path / "sweep-sweep.png").exists()


def test_an_unreadable_trace_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "bad.jsonl").write_text('{"timestamp": 0}\n')
    argv = ["bench", "replay", "--trace", str(tmp_path / "bad.jsonl"), "--quiet"]
    assert main(argv) == 2
    assert "bad.jsonl:1: input_length must be an integer" in capsys.readouterr().err


def test_sessions_are_flags_simulated_only() -> None:
    settings, _ = _settings("--sessions", "--session-ttl-secs", "off")
    assert settings.sessions
    assert settings.prefix.session_ttl_secs is None
    with pytest.raises(ValueError, match="sessions are simulated"):
        _settings("--sessions", "--mode", "live")


def test_a_replay_with_sessions_names_each_conversation(tmp_path: Path) -> None:
    """Conversations are derived from the trace: the block after the shared first one."""
    assert conversation(TraceRequest(0, 30, 1, (0, 7, 8))) == "7"
    assert conversation(TraceRequest(0, 10, 1, (5,))) == "5"
    out = tmp_path / "sessions.json"
    argv = ["bench", "replay", "--trace", str(_trace(tmp_path)), "--pods", "2", "--quiet"]
    argv += ["--policies", "prefix", "--sessions", "--sweep", "session-ttl-secs=off,60"]
    assert main([*argv, "--no-plots", "--out", str(out)]) == 0
    points = json.loads(out.read_text())["sweep"]["points"]
    assert [p["value"] for p in points] == ["off", "60"]
