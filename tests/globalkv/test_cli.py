"""The dispatcher: the environment mapping containers use, and commands that cannot run."""

from __future__ import annotations

import argparse
from importlib.metadata import EntryPoint

import pytest

from globalkv.cli import env_argv, main, parse
from kvplumbing.environment import env_var_name


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=1)
    parser.add_argument("--redis-url")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--prefill", nargs="+", action="append")
    return parser


def test_env_var_name_follows_command_and_flag() -> None:
    assert env_var_name("gateway", "--redis-url") == "GLOBALKV_GATEWAY_REDIS_URL"


def test_env_fills_flags_not_given_on_the_command_line() -> None:
    env = {"GLOBALKV_GW_PORT": "9000", "GLOBALKV_GW_REDIS_URL": "redis://r:6379/0"}
    tokens = env_argv("gw", _parser(), ["--port", "7"], env)
    assert tokens == ["--redis-url", "redis://r:6379/0"]
    args = _parser().parse_args([*tokens, "--port", "7"])
    assert args.port == 7
    assert args.redis_url == "redis://r:6379/0"


def test_repeatable_flags_split_on_commas_and_shell_words() -> None:
    env = {"GLOBALKV_GW_PREFILL": "http://p0:30000 8998, http://p1:30000 none"}
    args = _parser().parse_args(env_argv("gw", _parser(), [], env))
    assert args.prefill == [["http://p0:30000", "8998"], ["http://p1:30000", "none"]]


@pytest.mark.parametrize(("value", "expected"), [("true", True), ("1", True), ("off", False)])
def test_boolean_flags(value: str, expected: bool) -> None:
    args = _parser().parse_args(env_argv("gw", _parser(), [], {"GLOBALKV_GW_VERBOSE": value}))
    assert args.verbose is expected


def test_a_non_boolean_value_for_a_boolean_flag_is_refused() -> None:
    with pytest.raises(ValueError, match="GLOBALKV_GW_VERBOSE"):
        env_argv("gw", _parser(), [], {"GLOBALKV_GW_VERBOSE": "maybe"})


def test_the_log_level_default_comes_from_the_environment_given() -> None:
    args = parse(["pods", "--indexer", "http://x"], {"GLOBALKV_LOG_LEVEL": "DEBUG"})
    assert args.log_level == "DEBUG"


def test_an_invalid_configuration_stops_before_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["indexer", "--block-size", "0", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("globalkv indexer: invalid configuration: block_size:")


def test_a_plugin_that_cannot_be_imported_leaves_every_other_command_working(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import globalkv.cli as cli

    real = cli.entry_points
    broken = EntryPoint("broken", "no_such_module_for_globalkv:register", cli.ENTRY_POINT_GROUP)
    monkeypatch.setattr(cli, "entry_points", lambda group: [*real(group=group), broken])
    assert parse(["pods", "--indexer", "http://x"], {}).command == "pods"
    assert main(["broken", "--any", "args"]) == 2
    err = capsys.readouterr().err
    assert "globalkv broken is unavailable: No module named 'no_such_module_for_globalkv'" in err


def test_a_command_whose_extra_is_missing_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    real = importlib.util.find_spec

    def without_bench(name: str, package: str | None = None) -> object:
        return None if name in {"numpy", "matplotlib"} else real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", without_bench)
    assert main(["bench", "replay", "--trace", "t.jsonl"]) == 2
    assert capsys.readouterr().err == (
        "globalkv bench replay needs numpy and matplotlib: pip install 'globalkv[bench]'\n"
    )
    assert main(["--check", "bench", "replay", "--trace", "t.jsonl", "--no-plots"]) == 2
    assert "needs numpy: pip install 'globalkv[bench]'" in capsys.readouterr().err
    assert main(["--check", "pods", "--indexer", "http://x"]) == 0
