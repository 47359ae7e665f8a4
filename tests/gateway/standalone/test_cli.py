"""sglang-router's flags as they are, mapped onto GatewayConfig."""

from __future__ import annotations

import argparse
import re
import socket
from pathlib import Path

import pytest
from pydantic import BaseModel

from gateway.settings.config import GatewayConfig
from gateway.settings.flags import FLAGLESS, SETTINGS, build_config
from gateway.standalone.cli import check_config, register, run
from globalkv.cli import env_argv
from tests.support.net import free_port


def parse_gateway(argv: list[str], env: dict[str, str]) -> argparse.Namespace:
    """Only this command's parser, the way the globalkv dispatcher builds and feeds it."""
    parser = argparse.ArgumentParser(prog="globalkv")
    parser.add_argument("--check", action="store_true")
    sub = parser.add_subparsers(dest="command")
    register(sub)
    extra = env_argv("gateway", sub.choices["gateway"], argv, env)
    return parser.parse_args(["gateway", *extra, *argv])


def config_of(*argv: str, env: dict[str, str] | None = None) -> GatewayConfig:
    return build_config(parse_gateway(list(argv), env or {}))


def test_the_briefs_command_line() -> None:
    cfg = config_of(
        "--pd-disaggregation",
        "--prefill", "http://127.0.0.1:30001", "8998",
        "--prefill", "http://127.0.0.1:30002", "none",
        "--prefill", "http://127.0.0.1:30003",
        "--decode", "http://127.0.0.1:30011",
        "--indexer-url", "http://127.0.0.1:8100",
    )  # fmt: skip
    assert [(s.url, s.bootstrap_port) for s in cfg.prefill] == [
        ("http://127.0.0.1:30001", 8998),
        ("http://127.0.0.1:30002", None),
        ("http://127.0.0.1:30003", None),
    ]
    assert [s.url for s in cfg.decode] == ["http://127.0.0.1:30011"]
    assert (cfg.prefill_policy, cfg.decode_policy) == ("prefix", "power_of_two")
    assert (cfg.port, cfg.prometheus_port, cfg.request_timeout_secs) == (30000, 29000, 1800)
    assert cfg.retry.max_retries == 5
    assert cfg.breaker.failure_threshold == 10
    assert cfg.health.interval_secs == 60


def test_router_flags_map_to_the_config() -> None:
    cfg = config_of(
        "--prefill", "http://p:1", "--decode", "http://d:2",
        "--policy", "round_robin", "--decode-policy", "cache_aware",
        "--cache-threshold", "0.5", "--balance-abs-threshold", "32",
        "--retry-max-retries", "3", "--retry-initial-backoff-ms", "10", "--disable-retries",
        "--cb-failure-threshold", "4", "--cb-timeout-duration-secs", "9",
        "--health-check-interval-secs", "7", "--health-check-endpoint", "/healthz",
        "--api-key", "k", "--admin-token", "a", "--max-payload-size", "100",
        "--prefix-queued-weight", "0.25", "--tokenizer-path", "byte", "--log-level", "debug",
        "--prometheus-port", "0",
    )  # fmt: skip
    assert (cfg.prefill_policy, cfg.decode_policy) == ("round_robin", "cache_aware")
    assert (cfg.cache_aware.cache_threshold, cfg.cache_aware.balance_abs_threshold) == (0.5, 32)
    assert (cfg.retry.max_retries, cfg.retry.initial_backoff_ms, cfg.retry.disabled) == (
        3,
        10,
        True,
    )
    assert (cfg.breaker.failure_threshold, cfg.breaker.timeout_duration_secs) == (4, 9)
    assert (cfg.health.interval_secs, cfg.health.endpoint) == (7, "/healthz")
    assert (cfg.api_key, cfg.admin_token, cfg.max_payload_size) == ("k", "a", 100)
    assert (cfg.prefix.queued_weight, cfg.tokenizer, cfg.prometheus_port) == (0.25, "byte", None)


def test_index_flags_are_part_of_the_config() -> None:
    cfg = config_of(
        "--redis-url", "redis://r:6379/0", "--block-size", "16", "--redis-prefix", "a",
    )  # fmt: skip
    assert (cfg.redis_url, cfg.block_size, cfg.redis_prefix) == ("redis://r:6379/0", 16, "a")
    cfg = config_of("--indexer-url", "http://i:8100", "--indexer-token", "t")
    assert (cfg.indexer_url, cfg.indexer_token, cfg.redis_prefix) == ("http://i:8100", "t", "gkv")


def test_a_tokenizer_that_cannot_be_loaded_stops_the_start_with_the_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    args = parse_gateway(["--decode", "http://d:1", "--tokenizer", str(tmp_path)], {})
    with caplog.at_level("ERROR", logger="gateway.serving.launch"):
        assert run(args) == 1
    assert f"no tokenizer.json at {tmp_path}" in caplog.text


@pytest.mark.parametrize("taken", ["--port", "--prometheus-port"])
def test_a_port_taken_is_named_with_its_flag(taken: str, caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy, free = holder.getsockname()[1], free_port()
        ports = {"--port": free, "--prometheus-port": free, taken: busy}
        argv = ["--decode", "http://127.0.0.1:1", "--host", "127.0.0.1"]
        argv += ["--prometheus-host", "127.0.0.1"]
        argv += [item for flag, port in ports.items() for item in (flag, str(port))]
        with caplog.at_level("ERROR", logger="gateway.serving.launch"):
            assert run(parse_gateway(argv, {})) == 1
    assert f"127.0.0.1:{busy} ({taken})" in caplog.text
    assert f":{free} " not in caplog.text


def test_environment_supplies_repeatable_flags() -> None:
    env = {
        "GLOBALKV_GATEWAY_PREFILL": "http://a:1 8998,http://b:1 none",
        "GLOBALKV_GATEWAY_DECODE": "http://c:1",
        "GLOBALKV_GATEWAY_DISABLE_HEALTH_CHECK": "true",
    }
    cfg = config_of(env=env)
    assert [(s.url, s.bootstrap_port) for s in cfg.prefill] == [
        ("http://a:1", 8998),
        ("http://b:1", None),
    ]
    assert cfg.health.disabled


def test_the_admin_door_through_flags_and_environment() -> None:
    assert config_of().insecure is False
    assert config_of("--insecure").insecure is True
    cfg = config_of(env={"GLOBALKV_GATEWAY_INSECURE": "on", "GLOBALKV_GATEWAY_ADMIN_TOKEN": "t"})
    assert (cfg.insecure, cfg.admin_token) == (True, "t")
    assert "'t'" not in repr(cfg)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prefill", "http://p:1", "x"], "number or none"),
        (["--prefill", "http://p:1", "1", "2"], "URL [BOOTSTRAP_PORT|none]"),
        (["--prefill", "p:1"], "http(s) URL"),
        (["--decode", "http://d:1/a b"], "whitespace or control characters"),
        (["--prefill", "http://p:1", "70000"], "less than or equal to 65535"),
        (["--decode", "http://d:1", "--decode", "http://d:1"], "listed twice"),
        (["--worker-urls", "http://w:1"], "regular mode"),
        (["--indexer-url", "http://i:1", "--redis-url", "redis://r"], "redis"),
        (["--decode-policy", "prefix"], "prefill caches"),
        (["--retry-jitter-factor", "2"], "jitter_factor"),
        (["--health-check-endpoint", "health"], "endpoint: 'health' is not a path"),
        (["--prefix-pending-grace-secs", "-1"], "greater than or equal to 0"),
        (["--prefix-pending-grace-secs", "inf"], "finite number"),
        (["--prefix-queued-weight", "nan"], "finite number"),
        (["--admin-token", ""], "admin_token"),
        (["--indexer-token", ""], "indexer_token"),
    ],
)
def test_invalid_flags_are_refused_with_the_reason(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        config_of(*argv)


def test_the_pending_grace_takes_seconds_or_off_and_says_so_otherwise(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert config_of("--prefix-pending-grace-secs", "0.5").prefix.pending_grace_secs == 0.5
    assert config_of("--prefix-pending-grace-secs", "off").prefix.pending_grace_secs is None
    with pytest.raises(SystemExit):
        config_of("--prefix-pending-grace-secs", "soon")
    assert "'soon' is neither a number nor 'off'" in capsys.readouterr().err


def test_check_config_is_the_command_default() -> None:
    args = parse_gateway(["--prefill", "http://p:1", "8998", "--decode", "http://d:1"], {})
    assert args.check_config is check_config
    args.check_config(args)
    with pytest.raises(ValueError, match="number or none"):
        check_config(parse_gateway(["--prefill", "http://p:1", "nope"], {}))


def test_every_setting_has_a_flag_with_the_fields_default_or_is_listed_flagless() -> None:
    defaults = vars(parse_gateway([], {}))
    models = {model for _, model, _ in SETTINGS}
    for _, model, flags in SETTINGS:
        flagless = set(FLAGLESS.get(model, {}))
        assert set(flags) | flagless == set(model.model_fields), model.__name__
        assert not set(flags) & flagless, model.__name__
        for field in flags:
            default = model.model_fields[field].get_default(call_default_factory=True)
            assert defaults[f"{model.__name__}.{field}"] == default, field
    kinds = [f.annotation for f in GatewayConfig.model_fields.values()]
    sections = {k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)}
    assert sections == models - {GatewayConfig}, "every section of GatewayConfig has its flags"
    assert defaults["prometheus_port"] == GatewayConfig.model_fields["prometheus_port"].default


def test_no_flags_give_the_models_defaults() -> None:
    assert config_of() == GatewayConfig()
