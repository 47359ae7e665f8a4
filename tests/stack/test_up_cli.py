"""`globalkv up` flags and environment → `StackConfig`; `--check` plans without starting."""

from __future__ import annotations

import itertools
import json
import shlex
import socket
from pathlib import Path

import pytest

from globalkv.cli import main, parse
from globalkv.stack.cluster import ComponentStatus
from globalkv.stack.config import StackConfig
from globalkv.stack.plan import plan_stack
from globalkv.stack.render import DEMO_PROMPT, curl_lines, table
from globalkv.stack.up import config_from_args
from tests.support.net import free_port


def config(*argv: str, env: dict[str, str] | None = None) -> StackConfig:
    return config_from_args(parse(["up", *argv], env or {}))


def test_defaults_are_two_by_two_on_port_8000_in_memory() -> None:
    stack = config()
    assert (stack.prefill, stack.decode, stack.gateway_port) == (2, 2, 8000)
    assert stack.redis_url is None
    assert stack.run_dir is None
    assert (stack.model, stack.block_size, stack.tokenizer) == ("emulated-model", 16, "byte")


def test_convenience_flags_become_component_flags() -> None:
    stack = config(
        "--kv-capacity",
        "64",
        "--policy",
        "round_robin",
        "--prefill-args=--prefill-tokens-per-s 5000",
        "--prefill-args=--tp 2",
        "--gateway-args=--seed 7",
        "--decode-args",
        "--decode-tokens-per-s 50",
    )
    assert stack.prefill_args == [
        *("--kv-capacity", "64"),
        *("--prefill-tokens-per-s", "5000"),
        *("--tp", "2"),
    ]
    assert stack.gateway_args == ["--prefill-policy", "round_robin", "--seed", "7"]
    assert stack.decode_args == ["--decode-tokens-per-s", "50"]


def test_every_flag_also_reads_the_environment() -> None:
    stack = config(
        env={
            "GLOBALKV_UP_PREFILL": "3",
            "GLOBALKV_UP_REDIS_URL": "redis://127.0.0.1:7000/0",
            "GLOBALKV_UP_RUN_DIR": "/tmp/r",
            "GLOBALKV_UP_DECODE_ARGS": shlex.quote("--decode-tokens-per-s 50"),
        }
    )
    assert stack.prefill == 3
    assert stack.redis_url == "redis://127.0.0.1:7000/0"
    assert stack.run_dir == Path("/tmp/r")
    assert stack.decode_args == ["--decode-tokens-per-s", "50"]


def test_the_admin_token_and_insecure_from_flags_or_the_environment() -> None:
    assert (config().token, config().insecure) == (None, False)
    assert config(env={"GLOBALKV_UP_ADMIN_TOKEN": "t0ken"}).token == "t0ken"
    assert config("--insecure", "--host", "10.213.0.1").insecure
    with pytest.raises(ValueError, match="--admin-token"):
        config("--host", "10.213.0.1")


def test_check_plans_the_cluster_without_starting_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--check", "up", "--redis-url", "redis://127.0.0.1:7000/0"]) == 0
    assert "configuration ok" in capsys.readouterr().out
    assert main(["--check", "up", "--redis-url", "redis+cluster://a:7000,b:7001/"]) == 0
    assert main(["--check", "up", "--redis-cluster", "3"]) == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prefill-args=--kv-capacity 0"], "prefill-0: kv_capacity"),
        (["--prefill", "0"], "prefill"),
        (["--redis-url", "localhost:6379"], "redis_url"),
        (["--redis-url", "redis+cluster://a:x/"], "is not host:port"),
        (["--redis-cluster", "2"], "redis_cluster"),
        (["--redis-cluster", "3", "--redis-url", "redis://a:1/0"], "exclusive"),
        (["--gateway-args=--decode-policy prefix"], "gateway: "),
    ],
)
def test_check_refuses_what_a_component_would(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--check", "up", *argv]) == 2
    assert message in capsys.readouterr().err


def test_run_refuses_an_invalid_configuration_before_starting(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["up", "--decode", "0"]) == 2
    assert "invalid configuration" in capsys.readouterr().err


class _Urls:
    gateway_url = "http://127.0.0.1:8000"
    indexer_url = "http://127.0.0.1:8100"


def test_the_table_lists_every_component_with_its_address(tmp_path: Path) -> None:
    plan = plan_stack(StackConfig(prefill=1, decode=1), itertools.count(9000), tmp_path)
    statuses = [
        ComponentStatus(c.name, c.role, c.url, 100 + i, c.log_path, None, c.bootstrap_url, c.pod)
        for i, c in enumerate(plan.components)
    ]
    statuses[2] = ComponentStatus(
        "decode-0", "decode", plan.get("decode-0").url, 102, tmp_path / "decode-0.log", -9
    )
    lines = table(statuses, plan).splitlines()
    assert lines[0].split() == ["COMPONENT", "URL", "DETAILS", "PID", "LOG"]
    assert lines[1].split()[:2] == ["indexer", plan.indexer.url]
    assert f"KV events in on {plan.indexer.events_endpoint}" in lines[1]
    assert f"pod prefill-0, bootstrap {plan.get('prefill-0').bootstrap_url}" in lines[2]
    assert "exited -9" in lines[3]
    assert lines[4].split()[0] == "gateway"


def test_the_curl_lines_are_valid_requests() -> None:
    lines = [line.strip() for line in curl_lines(_Urls(), "m").splitlines()]
    commands = [shlex.split(line) for line in lines if line.startswith("curl")]
    assert [c[2] for c in commands] == [
        "http://127.0.0.1:8000/v1/chat/completions",
        "http://127.0.0.1:8000/v1/completions",
        "http://127.0.0.1:8100/v1/lookup",
    ]
    bodies = [json.loads(c[c.index("-d") + 1]) for c in commands]
    assert bodies[0]["messages"][0]["role"] == "user"
    assert bodies[1]["prompt"] == bodies[2]["text"] == DEMO_PROMPT
    assert all(body["model"] == "m" for body in bodies)
    assert lines[-1] == (
        "python -m globalkv doctor --gateway http://127.0.0.1:8000 --indexer http://127.0.0.1:8100"
    )
    with_token = curl_lines(_Urls(), "m", admin_token=True).splitlines()
    assert with_token[-1].endswith("--indexer http://127.0.0.1:8100 --admin-token TOKEN")
    assert "TOKEN: the admin token given to up" in with_token[-2]
    (lookup,) = [shlex.split(line) for line in with_token if "/v1/lookup" in line]
    assert lookup[lookup.index("authorization: Bearer TOKEN") - 1] == "-H"


def test_an_unreachable_redis_is_named_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    dead = f"redis://127.0.0.1:{free_port()}/0"
    assert main(["up", "--redis-url", dead, "--run-dir", str(run_dir), "--port", "0"]) == 1
    assert f"Redis at {dead} does not answer" in capsys.readouterr().err
    assert not run_dir.exists(), "no component was started"


def test_a_taken_gateway_port_is_named_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["up", "--port", str(port), "--run-dir", str(run_dir)]) == 1
    assert f"the gateway's port {port} on 127.0.0.1 is taken" in capsys.readouterr().err
    assert not run_dir.exists(), "no component was started"
