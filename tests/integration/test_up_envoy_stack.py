"""`globalkv up --entry envoy` on Redis, with the replicas' shared state on, as the
Kubernetes manifests run the picker: the doctor command `up` prints passes against the
stack it started (the probe enters at Envoy, the picker is read as the gateway, the
sidecars' lack of /server_info is no warning), and the alert rules of
deploy/kubernetes/components/monitoring read only metrics and labels the stack exports."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy import dashboard
from tests.deploy.test_monitoring import TARGET_LABELS, rule_reads
from tests.support.net import free_port, wait_for
from tests.support.procs import Proc
from tests.support.redis import RedisServer

pytestmark = pytest.mark.integration


@dataclass
class Stack:
    up: Proc
    run_dir: Path

    def manifest(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.run_dir / "cluster.json").read_text())
        return data


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    redis = RedisServer()
    run_dir = tmp_path_factory.mktemp("up-envoy")
    up = Proc.globalkv(
        "up",
        *("--entry", "envoy", "--port", str(free_port()), "--run-dir", str(run_dir)),
        *("--redis-url", redis.url, "--health-check-interval", "1"),
        "--gateway-args=--share-state-interval-secs 1",
        name="up",
    )
    try:

        def printed() -> bool:
            if not up.alive():
                raise RuntimeError(f"globalkv up exited:\n{up.log()}")
            return "Ctrl-C stops everything" in up.log()

        wait_for(printed, timeout=90, what="globalkv up --entry envoy to be ready")
        yield Stack(up, run_dir)
    finally:
        up.stop(timeout=30)
        redis.stop()


def _printed_doctor(log: str) -> list[str]:
    (line,) = [line.strip() for line in log.splitlines() if " globalkv doctor " in line]
    argv = shlex.split(line)
    assert argv[:3] == ["python", "-m", "globalkv"], line
    return [sys.executable, *argv[1:]]


@pytest.mark.timeout(180)
def test_the_doctor_line_up_prints_passes_on_the_stack_it_started(stack: Stack) -> None:
    doctor = _printed_doctor(stack.up.log())
    assert "--entry" in doctor
    done = subprocess.run(
        [*doctor, "--json"], capture_output=True, text=True, timeout=90, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    found = {
        stage["key"]: [f for f in stage["findings"] if f["level"] != "ok"]
        for stage in report["stages"]
    }
    assert found["gateway"] == [], found["gateway"]
    assert found["probe"] == [], found["probe"]
    routing = {f["subject"]: f for s in report["stages"] for f in s["findings"]}
    assert routing["repeated probe"]["level"] == "ok", routing["repeated probe"]


def _exported(urls: list[str]) -> dict[str, set[str] | None]:
    """Each metric family the services export, with the labels its samples carry (None
    while it has no sample: a labelled family before its first use)."""
    families: dict[str, set[str] | None] = {}
    for url in urls:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        for metric in text_string_to_metric_families(text):
            families.setdefault(metric.name, None)
            for sample in metric.samples:
                families[metric.name] = (families[metric.name] or set()) | set(sample.labels)
    return families


@pytest.mark.timeout(120)
def test_the_alert_rules_read_only_what_the_stack_exports(stack: Stack) -> None:
    components = stack.manifest()["components"]
    urls = [c["url"] for c in components if c["role"] in ("indexer", "epp", "sidecar")]
    # Requests through Envoy, so that the picker's request and routing metrics have samples.
    body = {"model": "emulated-model", "prompt": "alerts " * 40, "max_tokens": 2}
    for _ in range(2):
        answer = httpx.post(
            f"{stack.manifest()['gateway_url']}/v1/completions", json=body, timeout=30
        )
        assert answer.status_code == 200, answer.text
    exported = _exported(urls)
    for alert, read in rule_reads():
        if read.metric == "up":  # Prometheus' own, for each target it scrapes
            continue
        name = dashboard.family(read.metric)
        assert name in exported, f"{alert}: {read.metric} is exported by no service"
        labels = exported[name]
        if labels is not None:  # a family without samples yet has no labels to check
            used = (read.grouped_by | read.matched) - TARGET_LABELS - {"le"}
            assert used <= labels, f"{alert}: {used - labels} on {read.metric}"
