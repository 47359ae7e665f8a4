"""The compose stack on its cluster profile (docker-compose.cluster.yml), for real: the
index and pod registry on a Redis Cluster of 3 masters and 3 replicas, a chat through the
published gateway twice until the second reuses the first's prefix, the keys on the
cluster's nodes.

Skipped, with the reason, only where no engine can start (`tests.support.docker`). The
image is built under a tag of this run's own (removed after) and named by an extra compose
file, so the `globalkv:local` other runs use is left alone.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.support.docker import ROOT, ComposeProject, compose_or_skip
from tests.support.net import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

IMAGE = f"globalkv:compose-cluster-test-{os.getpid()}"
"""Of this run alone: other checkouts may run this test at the same time."""
GLOBALKV = ("indexer", "prefill-0", "prefill-1", "decode-0", "decode-1", "gateway")
NODES = {f"redis-node-{n}" for n in range(6)}
SERVICES = {*GLOBALKV, *NODES, "redis"}
MESSAGES = [
    {"role": "system", "content": "You answer questions about a sharded KV index. " * 4},
    {"role": "user", "content": "Which prefill holds the longest prefix of this prompt?"},
]


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ComposeProject, str]]:
    command = compose_or_skip()
    built = subprocess.run(
        ["docker", "build", "--network", "host", "-t", IMAGE, "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
    image = tmp_path_factory.mktemp("compose") / "image.yml"
    image.write_text(yaml.safe_dump({"services": {s: {"image": IMAGE} for s in GLOBALKV}}))
    ports = {name: free_port() for name in ("GATEWAY", "INDEX", "METRICS")}
    env = {f"GLOBALKV_PUBLISHED_{name}_PORT": str(port) for name, port in ports.items()}
    env["COMPOSE_HTTP_TIMEOUT"] = "300"  # 13 containers at once on a busy engine
    stack = ComposeProject(
        command,
        name=f"globalkv-cluster-test-{os.getpid()}",
        env=env,
        files=[ROOT / "docker-compose.yml", ROOT / "docker-compose.cluster.yml", Path(image)],
    )
    try:
        stack.up()
        stack.wait_healthy(SERVICES, timeout=300)
        yield stack, f"http://127.0.0.1:{ports['GATEWAY']}"
    finally:
        stack.down()
        subprocess.run(["docker", "image", "rm", IMAGE], capture_output=True, check=False)


def _chat(gateway: str) -> dict[str, Any]:
    body = {"model": "emulated-model", "messages": MESSAGES, "max_tokens": 8}
    response = httpx.post(f"{gateway}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def test_the_stack_runs_on_the_cluster_and_reuses_a_prefix(
    project: tuple[ComposeProject, str],
) -> None:
    stack, gateway = project
    assert stack.health()["redis-cluster"] == "exited", "the cluster was created"
    _chat(gateway)
    cached = 0
    deadline = time.monotonic() + 30
    while not cached and time.monotonic() < deadline:  # until the prefill's events landed
        cached = _chat(gateway)["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    nodes = stack.run("exec", "-T", "redis-node-0", "redis-cli", "cluster", "info").stdout
    assert "cluster_state:ok" in nodes
    assert "cluster_size:3" in nodes
    keys = 0
    for node in sorted(NODES):
        out = stack.run("exec", "-T", node, "redis-cli", "dbsize").stdout.strip()
        keys += int(out or 0)
    assert keys > 0, "the index and the registry live on the cluster's nodes"
