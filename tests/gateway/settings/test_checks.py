"""`globalkv --check` on the gateway, the endpoint picker and the sidecar: it fails on what
start-up would fail on (a tokenizer, a worker file, Kubernetes credentials, an extra), says
what the line gives (policies, index, tokenizer, discovery), shows no secret, and opens no
socket."""

from __future__ import annotations

import importlib.util
import os
import socket
from pathlib import Path

import pytest

from gateway.standalone.cli import check_config
from globalkv.cli import main
from tests.gateway.standalone.test_cli import parse_gateway
from tests.support.kubeconfig import CONTEXT, SERVER, write_kubeconfig
from tests.test_tokenize import CHATML, build_core, write_model

PD = ["--prefill", "http://10.0.0.1:30000", "8998", "--decode", "http://10.0.0.2:30000"]
DISCOVERY = [
    "--service-discovery",
    "--prefill-selector", "globalkv.io/role=prefill",
    "--decode-selector", "globalkv.io/role=decode",
    "--service-discovery-port", "30000",
    "--service-discovery-namespace", "llm",
]  # fmt: skip


@pytest.fixture(autouse=True)
def _host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No GLOBALKV_* variable from the caller, no kubeconfig but the test's, and no socket:
    a check reads files only."""
    for name in list(os.environ):
        if name.startswith("GLOBALKV_") or name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("a check opened a socket")

    monkeypatch.setattr(socket.socket, "__init__", refused)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    config = {"bos_token": "<s>", "chat_template": CHATML}
    return write_model(tmp_path / "model", build_core(), config)


def test_a_prefix_line_says_what_it_routes_by_and_hides_the_redis_password(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "kubeconfig")))
    argv = [
        *DISCOVERY,
        "--redis-url", "redis://:s3cret@redis:6379/0",
        "--block-size", "16",
        "--share-state-interval-secs", "1",
        "--tokenizer", str(model),
        "--model", "qwen",
    ]  # fmt: skip
    assert main(["--check", "gateway", *argv]) == 0
    out = capsys.readouterr().out
    assert "s3cret" not in out
    lines = out.splitlines()
    assert lines[0] == "globalkv gateway: configuration ok"
    said = dict(line.strip().split(": ", 1) for line in lines[1:])
    assert said["prefill policy"].startswith("prefix: the prefill holding the longest cached")
    assert said["decode policy"] == "power_of_two"
    assert said["index"] == (
        "Redis redis://:***@redis:6379/0, key prefix gkv, block size 16; loads shared with "
        "other replicas every 1 s"
    )
    assert said["tokenizer"] == f"{model} (loaded)"
    assert said["model"] == "qwen"
    assert said["discovery"] == (
        "Kubernetes, in llm: prefill pods labelled globalkv.io/role=prefill on port 30000; "
        "decode pods labelled globalkv.io/role=decode on port 30000; through kubeconfig "
        f"{tmp_path / 'kubeconfig'}, context {CONTEXT}, API server {SERVER}"
    )


@pytest.mark.parametrize(
    ("argv", "policy"),
    [
        (PD, "prefix, but no index (--redis-url or --indexer-url): by load"),
        (
            [*PD, "--indexer-url", "http://indexer:8100"],
            "prefix for requests carrying input_ids; text and chat prompts by load "
            "(no --tokenizer)",
        ),
        ([*PD, "--policy", "round_robin"], "round_robin: by load, not by cache"),
    ],
)
def test_a_line_that_routes_by_load_says_so(
    argv: list[str], policy: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--check", "gateway", *argv]) == 0
    out = capsys.readouterr().out
    assert f"  prefill policy: {policy}\n" in out
    reads = "this policy reads none" if "round_robin" in argv else "routed by load"
    (tokenizer,) = [line for line in out.splitlines() if line.startswith("  tokenizer: ")]
    assert tokenizer.startswith("  tokenizer: none: ")
    assert tokenizer.endswith(reads)


def test_a_tokenizer_that_would_not_load_fails_the_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    broken = tmp_path / "broken" / "tokenizer.json"
    broken.parent.mkdir()
    broken.write_text('{"model": "no"}')
    for path, why in (
        (tmp_path / "missing", "no such file or directory"),
        (tmp_path / "empty", "no tokenizer.json at"),
        (broken, "is not a valid tokenizer.json"),
    ):
        assert main(["--check", "gateway", *PD, "--tokenizer", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("globalkv gateway: invalid configuration: "), err
        assert why in err, err


def test_only_an_explicit_check_loads_the_tokenizer(tmp_path: Path) -> None:
    """Start-up loads it right after the dispatcher's check: it is not read twice. A path
    that does not exist fails either way."""
    broken = tmp_path / "tokenizer.json"
    broken.write_text("{}")
    starting = parse_gateway([*PD, "--tokenizer", str(broken)], {})
    assert "  tokenizer: " + str(broken) in ["  " + line for line in check_config(starting)]
    starting.check = True
    with pytest.raises(ValueError, match=r"is not a valid tokenizer\.json"):
        check_config(starting)
    missing = parse_gateway([*PD, "--tokenizer", str(tmp_path / "nothing")], {})
    with pytest.raises(ValueError, match="no such file"):
        check_config(missing)


def test_a_hub_id_is_read_from_the_cache_never_the_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    repo = cache / "models--Qwen--Qwen2.5-0.5B-Instruct"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("a" * 40)
    write_model(repo / "snapshots" / ("a" * 40), build_core(), {"chat_template": CHATML})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    assert main(["--check", "gateway", *PD, "--tokenizer", "Qwen/Qwen2.5-0.5B-Instruct"]) == 0
    assert f"from the Hugging Face cache {cache}; loaded" in capsys.readouterr().out
    assert main(["--check", "gateway", *PD, "--tokenizer", "nobody/not-cached"]) == 0
    out = capsys.readouterr().out
    assert "not in the Hugging Face cache" in out
    assert "start-up downloads its tokenizer files" in out
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert main(["--check", "gateway", *PD, "--tokenizer", "nobody/not-cached"]) == 2
    assert "HF_HUB_OFFLINE forbids downloading it" in capsys.readouterr().err


def test_discovery_without_credentials_or_its_extra_fails_the_check(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--check", "gateway", *DISCOVERY]) == 2
    err = capsys.readouterr().err
    assert "Kubernetes service discovery has no credentials" in err
    assert "no-kubeconfig not found" in err
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, package=None: None if name == "lightkube" else real(name, package),
    )
    assert main(["--check", "gateway", *DISCOVERY]) == 2
    assert capsys.readouterr().err == (
        "Kubernetes service discovery needs lightkube: pip install 'globalkv[kubernetes]'\n"
    )


def test_a_worker_file_must_be_there_and_valid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    listed = tmp_path / "workers.yaml"
    assert main(["--check", "gateway", "--worker-file", str(listed)]) == 2
    assert f"--worker-file {listed}: [Errno 2]" in capsys.readouterr().err
    listed.write_text("workers:\n  - {url: 'http://10.0.0.1:30000', role: primary}\n")
    assert main(["--check", "gateway", "--worker-file", str(listed)]) == 2
    assert "workers.0.role" in capsys.readouterr().err
    listed.write_text(
        "workers:\n  - {url: 'http://10.0.0.1:30000', role: prefill, bootstrap_port: 8998}\n"
        "  - {url: 'http://10.0.0.2:30000', role: decode}\n"
    )
    assert main(["--check", "gateway", "--worker-file", str(listed)]) == 0
    assert (
        f"discovery: the file {listed}, read again as it changes; it lists 1 prefill and "
        "1 decode now" in capsys.readouterr().out
    )


def test_the_picker_needs_the_epp_extra_and_traces_need_otel(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--check", "epp", *PD]) == 0
    out = capsys.readouterr().out
    assert "  endpoint picker: ext_proc on 0.0.0.0:9002, PD, each decode at its sidecar\n" in out
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, package=None: (
            None if name.split(".")[0] in {"h2", "opentelemetry"} else real(name, package)
        ),
    )
    assert main(["--check", "epp", *PD]) == 2
    assert capsys.readouterr().err == ("globalkv epp needs h2: pip install 'globalkv[epp]'\n")
    traced = [*PD, "--otlp-traces-endpoint", "http://collector:4318/v1/traces"]
    assert main(["--check", "gateway", *traced]) == 2
    assert "pip install 'globalkv[otel]'" in capsys.readouterr().err


def test_the_sidecar_says_which_decode_it_fronts(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--decode", "http://127.0.0.1:30000", "--prefill", "http://10.0.0.1:30000", "8998"]
    assert main(["--check", "sidecar", *argv]) == 0
    out = capsys.readouterr().out
    assert "  local decode: http://127.0.0.1:30000, bound to the prefill the picker names\n" in out
