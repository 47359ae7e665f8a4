"""`globalkv bootstrap`: flags, environment, validation without binding."""

from __future__ import annotations

import socket

import pytest

from bootstrap.cli import config_from_args, run
from bootstrap.server import BootstrapConfig
from globalkv.cli import main, parse


def test_defaults_match_sglang() -> None:
    args = parse(["bootstrap"], {})
    assert config_from_args(args) == BootstrapConfig(
        host="0.0.0.0", port=8998, sglang_compat="0.5.23", room_ttl=120.0, max_rooms=100_000
    )


def test_flags_and_environment() -> None:
    env = {"GLOBALKV_BOOTSTRAP_SGLANG_COMPAT": "0.5.16", "GLOBALKV_BOOTSTRAP_PORT": "9001"}
    args = parse(
        [
            "bootstrap",
            "--host",
            "127.0.0.1",
            "--room-ttl",
            "30",
            "--max-rooms",
            "5",
            "--port",
            "9002",
        ],
        env,
    )
    config = config_from_args(args)
    assert (config.host, config.port, config.sglang_compat) == ("127.0.0.1", 9002, "0.5.16")
    assert (config.room_ttl, config.max_rooms) == (30.0, 5)
    assert (config.admin_token, config.insecure) == (None, False)


def test_the_reset_door_through_the_environment() -> None:
    env = {"GLOBALKV_BOOTSTRAP_ADMIN_TOKEN": "t0ken", "GLOBALKV_BOOTSTRAP_INSECURE": "yes"}
    config = config_from_args(parse(["bootstrap"], env))
    assert (config.admin_token, config.insecure) == ("t0ken", True)
    assert "t0ken" not in repr(config)


def test_check_accepts_a_valid_configuration(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--check", "bootstrap", "--port", "0"]) == 0
    assert "configuration ok" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--room-ttl", "0"], "room_ttl"),
        (["--room-ttl", "nan"], "room_ttl"),
        (["--max-rooms", "0"], "max_rooms"),
        (["--port", "70000"], "port"),
        (["--host", ""], "host"),
        (["--admin-token", ""], "admin_token"),
    ],
)
def test_check_refuses_bad_values_naming_them(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--check", "bootstrap", *argv]) == 2
    assert message in capsys.readouterr().err


def test_an_unknown_compat_version_is_an_argument_error() -> None:
    with pytest.raises(SystemExit):
        parse(["bootstrap", "--sglang-compat", "0.4.0"], {})


def test_run_refuses_a_bad_configuration_before_binding() -> None:
    args = parse(["bootstrap", "--port", "0", "--room-ttl", "-1"], {})
    assert run(args) == 2


def test_run_exits_1_when_the_port_is_taken() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        args = parse(
            ["bootstrap", "--host", "127.0.0.1", "--port", str(taken.getsockname()[1])], {}
        )
        assert run(args) == 1
