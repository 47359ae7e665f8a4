from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from enginesim.cli import config_from_args, run
from enginesim.config import EngineConfig, FaultSettings
from enginesim.faults import Faults
from enginesim.metrics import EngineMetrics
from globalkv.cli import main, parse


def config(*argv: str, env: dict[str, str] | None = None) -> EngineConfig:
    return config_from_args(parse(["engine", *argv], env or {}))


def test_flags_fill_the_typed_config_and_the_rest_keeps_its_defaults() -> None:
    built = config(
        "--role", "prefill", "--dp", "2", "--page-size", "32",
        "--kv-events-endpoint", "tcp://*:6000", "--kv-events-replay-endpoint", "tcp://*:6100",
        "--kv-events-format", "vllm-array", "--prefill-tokens-per-s", "1000",
        "--fault-drop-event-rate", "0.25", "--fault-seed", "3",
    )  # fmt: skip
    assert (built.role, built.dp, built.page_size, built.port) == ("prefill", 2, 32, 30000)
    assert built.kv_events.endpoint == "tcp://*:6000"
    assert built.kv_events.format == "vllm-array"
    assert built.latency.prefill_tokens_per_s == 1000
    assert built.latency.decode_tokens_per_s == 200
    assert (built.faults.drop_event_rate, built.faults.seed) == (0.25, 3)


def test_environment_fills_flags_not_given() -> None:
    env = {"GLOBALKV_ENGINE_ROLE": "decode", "GLOBALKV_ENGINE_TP": "4"}
    built = config("--tp", "2", env=env)
    assert (built.role, built.tp) == ("decode", 2)


def test_the_directory_door_is_closed_unless_configured() -> None:
    default = config("--role", "prefill")
    assert (default.bootstrap_admin_token, default.bootstrap_insecure) == (None, False)
    env = {
        "GLOBALKV_ENGINE_BOOTSTRAP_ADMIN_TOKEN": "t0ken",
        "GLOBALKV_ENGINE_BOOTSTRAP_INSECURE": "1",
    }
    built = config("--role", "prefill", env=env)
    assert (built.bootstrap_admin_token, built.bootstrap_insecure) == ("t0ken", True)
    assert "t0ken" not in repr(built)
    assert config("--role", "prefill", "--bootstrap-insecure").bootstrap_insecure is True


def test_none_disables_kv_events() -> None:
    built = config("--role", "prefill", "--kv-events-endpoint", "none")
    assert built.kv_events.endpoint is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--role", "decode", "--dp", "2"], "one DP rank"),
        (
            ["--role", "prefill", "--dp", "2", "--kv-events-replay-endpoint", "tcp://*:5558"],
            "overlap",
        ),
        (["--role", "prefill", "--fault-fail-rate", "1.5"], "fail_rate"),
        (["--role", "prefill", "--kv-events-endpoint", "udp://x:1"], "must be tcp"),
        (["--role", "prefill", "--kv-events-endpoint", "tcp://*:65535", "--dp", "2"], "65535"),
        (["--role", "prefill", "--page-size", "0"], "page_size"),
    ],
)
def test_invalid_configurations_raise_value_error_naming_the_problem(
    argv: list[str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        config(*argv)


def test_a_missing_tokenizer_stops_the_engine_with_a_clear_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    args = parse(["engine", "--role", "decode", "--port", "0", "--tokenizer", str(tmp_path)], {})
    assert run(args) == 1
    assert f"engine could not start: no tokenizer.json at {tmp_path}" in caplog.text


def test_check_mode_validates_without_starting(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--check", "engine", "--role", "prefill"]) == 0
    assert main(["--check", "engine", "--role", "decode", "--dp", "3"]) == 2
    assert "one DP rank" in capsys.readouterr().err


def test_faults_are_seeded_counted_and_never_issue_room_zero_as_wrong_room() -> None:
    registry = CollectorRegistry()
    settings = FaultSettings(wrong_room_rate=1.0, drop_event_rate=0.5, seed=11)
    faults = Faults(settings, EngineMetrics(registry))
    assert faults.metadata_room(2**63 - 1) == 1
    assert faults.metadata_room(41) == 42
    draws = [faults.drop_event_batch() for _ in range(200)]
    again = Faults(settings, EngineMetrics(CollectorRegistry()))
    again.metadata_room(2**63 - 1)
    again.metadata_room(41)
    assert [again.drop_event_batch() for _ in range(200)] == draws
    assert 50 < sum(draws) < 150
    dropped = registry.get_sample_value(
        "globalkv_engine_faults_injected_total", {"kind": "drop_event"}
    )
    assert dropped == sum(draws)
    assert not Faults(FaultSettings(), EngineMetrics(CollectorRegistry())).fail_request()
