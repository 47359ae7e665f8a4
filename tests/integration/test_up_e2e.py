"""`globalkv up` end to end: a real `up` process with 2 prefill and 2 decode engines.

One cluster serves the module: requests of every kind through the gateway, prefix reuse
checked in the index and in the engines' answers, `doctor` on a healthy cluster, then a
killed decode (reported by `up` and by `doctor`, routed around), and finally SIGINT, after
which no process of the cluster may remain. The last two tests change the cluster and run
last; each also works alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvplumbing.release import VERSION
from tests.deploy import dashboard
from tests.support.net import free_port, wait_for
from tests.support.procs import Proc

pytestmark = pytest.mark.integration

FAST_PREFILL = "--prefill-tokens-per-s 500000 --prefill-overhead-ms 1"
FAST_DECODE = "--decode-tokens-per-s 5000"
MODEL = "emulated-model"
BOS = 256
"""The byte tokenizer's BOS: a text prompt is [BOS, *utf-8 bytes]."""


@dataclass
class Up:
    proc: Proc
    run_dir: Path
    manifest: dict[str, Any]

    @property
    def gateway(self) -> str:
        return str(self.manifest["gateway_url"])

    @property
    def indexer(self) -> str:
        return str(self.manifest["indexer_url"])

    def component(self, name: str) -> dict[str, Any]:
        (found,) = [c for c in self.manifest["components"] if c["name"] == name]
        return found

    def pids(self) -> list[int]:
        return [int(c["pid"]) for c in self.manifest["components"]]

    def doctor(self) -> tuple[int, dict[str, Any]]:
        result = subprocess.run(
            [sys.executable, "-m", "globalkv", "doctor", "--run-dir", str(self.run_dir), "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode in (0, 1), result.stderr
        return result.returncode, json.loads(result.stdout)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    run_dir = tmp_path_factory.mktemp("up") / "run"
    proc = Proc.globalkv(
        "up",
        *("--prefill", "2", "--decode", "2", "--port", str(free_port())),
        *("--run-dir", str(run_dir), "--health-check-interval", "1"),
        f"--prefill-args={FAST_PREFILL}",
        f"--decode-args={FAST_DECODE}",
        name="up",
    )
    manifest = run_dir / "cluster.json"

    def ready() -> bool:
        if not proc.alive():
            raise RuntimeError(f"globalkv up exited:\n{proc.log()}")
        return manifest.exists()

    try:
        wait_for(ready, timeout=90, what="globalkv up to be ready")
        cluster = Up(proc, run_dir, json.loads(manifest.read_text()))
        yield cluster
    finally:
        proc.stop(timeout=30)
    for pid in cluster.pids():
        assert not _exists(pid), f"process {pid} outlived globalkv up"


def _post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url, json=body, timeout=30)


def _events(response: httpx.Response) -> list[Any]:
    lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


def test_up_prints_every_component_and_what_to_try(up: Up) -> None:
    out = up.proc.log()
    for component in up.manifest["components"]:
        assert component["name"] in out
        assert component["url"] in out
    assert f"curl -s {up.gateway}/v1/chat/completions" in out
    assert f"curl -s {up.indexer}/v1/lookup" in out
    assert "Ctrl-C stops everything" in out


def test_every_component_names_the_installed_release(up: Up) -> None:
    for component in up.manifest["components"]:
        url = component["url"]
        if component["role"] in ("prefill", "decode"):
            info = httpx.get(f"{url}/server_info", timeout=10).json()
            assert info["version"] == VERSION, component["name"]
        else:
            if component["role"] == "indexer":
                assert httpx.get(f"{url}/version", timeout=10).json() == {"version": VERSION}
            assert httpx.get(f"{url}/health", timeout=10).json()["version"] == VERSION
        if component["bootstrap_url"]:
            directory = httpx.get(f"{component['bootstrap_url']}/version", timeout=10)
            assert directory.json() == {"version": VERSION}
            assert httpx.get(f"{component['bootstrap_url']}/health", timeout=10).text == "OK"


def _exported(urls: list[str]) -> dict[str, set[str]]:
    """Each metric family the services export, with the labels its samples carry."""
    families: dict[str, set[str]] = {}
    for url in urls:
        for metric in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
            labels = families.setdefault(metric.name, set())
            for sample in metric.samples:
                labels.update(sample.labels)
    return families


def test_the_dashboard_reads_only_what_the_services_export(up: Up) -> None:
    urls = [c["url"] for c in up.manifest["components"]]
    urls += [c["bootstrap_url"] for c in up.manifest["components"] if c["bootstrap_url"]]
    # One routed request, so that the request and routing metrics carry their labels.
    assert _post(f"{up.gateway}/generate", {"text": "dashboards"}).status_code == 200
    exported = _exported(urls)
    for expr in dashboard.expressions(dashboard.load()):
        for read in dashboard.reads(dashboard.parse(expr)):
            name = dashboard.family(read.metric)
            assert name in exported, f"{read.metric} is exported by no service ({expr})"
            if exported[name]:  # a family without samples yet has no labels to check
                grouped = read.grouped_by - {"le", "instance", "job"}
                assert grouped <= exported[name], f"{expr}: {grouped - exported[name]}"


@pytest.mark.parametrize("stream", [False, True])
def test_chat_through_the_gateway(up: Up, stream: bool) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 6,
        "stream": stream,
    }
    response = _post(f"{up.gateway}/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    if stream:
        chunks = _events(response)
        assert chunks[0]["object"] == "chat.completion.chunk"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    else:
        answer = response.json()
        assert answer["choices"][0]["message"]["role"] == "assistant"
        assert answer["usage"]["completion_tokens"] == 6
        assert "cached_tokens" in answer["usage"]["prompt_tokens_details"]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_through_the_gateway(up: Up, stream: bool) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 5, "stream": stream}
    response = _post(f"{up.gateway}/v1/completions", body)
    assert response.status_code == 200, response.text
    if stream:
        chunks = _events(response)
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    else:
        answer = response.json()
        assert answer["object"] == "text_completion"
        assert answer["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("stream", [False, True])
def test_generate_through_the_gateway(up: Up, stream: bool) -> None:
    body = {"text": "The gateway binds", "sampling_params": {"max_new_tokens": 4}}
    response = _post(f"{up.gateway}/generate", {**body, "stream": stream})
    assert response.status_code == 200, response.text
    last = _events(response)[-1] if stream else response.json()
    meta = last["meta_info"]
    assert meta["completion_tokens"] == 4
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert set(meta["pd_stages_ms"]) >= {"register", "rank", "connect", "room", "consume"}


def _lookup(up: Up, **prompt: Any) -> dict[str, Any]:
    response = _post(f"{up.indexer}/v1/lookup", {"model": MODEL, **prompt})
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def test_repeated_prefixes_land_on_the_pod_that_cached_them(up: Up) -> None:
    prefix = f"[{uuid.uuid4().hex}] You are a terse assistant for a storage team. " * 5
    first = _post(
        f"{up.gateway}/v1/completions",
        {"model": MODEL, "prompt": prefix + "First question?", "max_tokens": 4},
    )
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    def indexed() -> bool:
        pods = _lookup(up, text=prefix)["pods"]
        return bool(pods) and pods[0]["hit_blocks"] == _lookup(up, text=prefix)["blocks"]

    wait_for(indexed, timeout=10, what="the prefix's blocks in the index")
    (holder,) = _lookup(up, text=prefix)["pods"]
    assert holder["pod"] in {"prefill-0", "prefill-1"}

    for question in ("Second question?", "Third question?"):
        again = _post(
            f"{up.gateway}/generate",
            {"text": prefix + question, "sampling_params": {"max_new_tokens": 4}},
        )
        assert again.status_code == 200, again.text
        meta = again.json()["meta_info"]
        assert meta["cached_tokens"] >= holder["hit_tokens"]
        assert meta["prefill_dp_rank"] == holder["dp_rank"]
    # Had a repeat gone to the other prefill, that pod would hold the prefix too.
    assert [p["pod"] for p in _lookup(up, text=prefix)["pods"]] == [holder["pod"]]


def test_the_index_answers_prefix_hits_for_text_and_tokens(up: Up) -> None:
    prompt = f"{uuid.uuid4().hex}: the index keys every full block of this prompt. " * 3
    response = _post(
        f"{up.gateway}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    )
    assert response.status_code == 200, response.text
    tokens = [BOS, *prompt.encode()]
    blocks = len(tokens) // 16
    wait_for(
        lambda: bool(_lookup(up, token_ids=tokens)["pods"]),
        timeout=10,
        what="the prompt in the index",
    )
    by_tokens = _lookup(up, token_ids=tokens)
    assert by_tokens["block_size"] == 16
    assert by_tokens["blocks"] == blocks
    (hit,) = by_tokens["pods"]
    assert hit["hit_blocks"] == blocks
    assert hit["hit_tokens"] == blocks * 16
    assert _lookup(up, text=prompt) == by_tokens
    other = _lookup(up, token_ids=[BOS, *f"{uuid.uuid4().hex} unseen".encode()] * 4)
    assert other["pods"] == []


def test_doctor_reports_a_healthy_cluster(up: Up) -> None:
    status, report = up.doctor()
    assert status == 0, json.dumps(report, indent=1)
    assert report["healthy"] is True
    levels = {stage["key"]: stage["level"] for stage in report["stages"]}
    expected = dict.fromkeys(["gateway", "directories", "index", "routing", "probe"], "ok")
    assert levels == expected, json.dumps(report["stages"], indent=1)
    routing = next(s for s in report["stages"] if s["key"] == "routing")
    settings = {f["subject"]: f["message"] for f in routing["findings"]}
    assert settings["gateway index"] == f"the indexer at {up.indexer}"
    assert settings["gateway tokenizer"] == "byte"
    probe = next(s for s in report["stages"] if s["key"] == "probe")
    assert [f["subject"] for f in probe["findings"]][:5] == [
        "register",
        "resolve",
        "connect",
        "verify-room",
        "consume",
    ]


def test_a_killed_decode_is_reported_and_routed_around(up: Up) -> None:
    decode = up.component("decode-1")
    os.kill(decode["pid"], signal.SIGKILL)
    wait_for(
        lambda: "decode-1 exited (signal 9)" in up.proc.log(),
        timeout=10,
        what="up to report the dead decode",
    )
    status, report = up.doctor()
    assert status == 1
    assert report["first_failing_stage"] == "gateway"
    gateway = next(s for s in report["stages"] if s["key"] == "gateway")
    failed = [f["subject"] for f in gateway["findings"] if f["level"] == "fail"]
    decode_id = decode["url"].removeprefix("http://")
    assert failed == [f"decode {decode_id}"]
    for i in range(6):
        body = {"text": f"routed around {i}", "sampling_params": {"max_new_tokens": 2}}
        response = _post(f"{up.gateway}/generate", body)
        assert response.status_code == 200, response.text


def test_sigint_stops_every_process(up: Up) -> None:
    up.proc.signal(signal.SIGINT)
    assert up.proc.popen.wait(30) == 0, up.proc.log()
    assert "globalkv up: stopped" in up.proc.log()
    alive = [pid for pid in up.pids() if _exists(pid)]
    assert alive == []
