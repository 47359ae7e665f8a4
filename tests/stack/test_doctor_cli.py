"""`globalkv doctor` arguments, the run directory of `up`, and exit statuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from globalkv.cli import main
from tests.support.net import free_port


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "give --gateway and/or --indexer"),
        (["--gateway", "ftp://gw:1"], "gateway: 'ftp://gw:1' is not an http(s) URL"),
        (["--indexer", "http://127.0.0.1:INDEX_PORT"], "has an invalid port"),
        (["--indexer", "http://127.0.0.1:99999"], "has an invalid port"),
        (["--indexer", "http://ix:1", "--timeout", "0"], "timeout"),
    ],
)
def test_check_refuses_unusable_arguments(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--check", "doctor", *argv]) == 2
    assert message in capsys.readouterr().err
    assert main(["doctor", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_check_takes_a_run_directory_without_reading_it() -> None:
    assert main(["--check", "doctor", "--run-dir", "/nonexistent"]) == 0


def test_a_run_directory_without_its_manifest_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["doctor", "--run-dir", str(tmp_path)]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_a_cluster_that_does_not_answer_exits_1_naming_the_gateway(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gateway = f"http://127.0.0.1:{free_port()}"
    (tmp_path / "cluster.json").write_text(json.dumps({"gateway_url": gateway}))
    assert main(["doctor", "--run-dir", str(tmp_path), "--json", "--timeout", "2"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["first_failing_stage"] == "gateway"
    gateway_stage = report["stages"][0]
    assert gateway_stage["findings"][0]["message"].startswith(f"{gateway}/health unreachable")


def test_a_run_directory_behind_envoy_reads_the_picker_and_probes_envoy() -> None:
    from globalkv.cli import parse
    from globalkv.stack.doctor.cli import config_from_args

    manifest = {
        "gateway_url": "http://127.0.0.1:8000",
        "indexer_url": "http://127.0.0.1:8100",
        "components": [
            {"name": "sidecar-0", "role": "sidecar", "url": "http://127.0.0.1:9100"},
            {"name": "epp", "role": "epp", "url": "http://127.0.0.1:9200"},
            {"name": "envoy", "role": "gateway", "url": "http://127.0.0.1:8000"},
        ],
    }
    config = config_from_args(parse(["doctor", "--run-dir", "r"], {}), manifest)
    assert (config.gateway, config.entry) == ("http://127.0.0.1:9200", "http://127.0.0.1:8000")
    plain = config_from_args(parse(["doctor", "--run-dir", "r"], {}), {"gateway_url": "http://g:1"})
    assert (plain.gateway, plain.entry) == ("http://g:1", None)
