"""`docker compose up` for real: the project's image, the repository's compose file, a
real Docker engine; requests through the published ports, `doctor` inside the compose
network, changes refused without the admin token, a prefill container killed under
traffic, then `down`.

Skipped, with the reason, only where no engine can start (`tests.support.docker`). The
published ports are moved to free ones through the compose file's own variables, and the
project gets a name of its own, so a stack a developer runs beside it is left alone.
"""

from __future__ import annotations

import os
import secrets
import time
import tomllib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from globalkv.tokenize import ByteTokenizer
from tests.support.docker import ROOT, ComposeProject, build_image, compose_or_skip
from tests.support.net import free_port, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

SERVICES = {"redis", "indexer", "prefill-0", "prefill-1", "decode-0", "decode-1", "gateway"}
ADMIN_TOKEN = secrets.token_urlsafe(16)
"""Given as compose users give it, through GLOBALKV_ADMIN_TOKEN."""
MESSAGES = [
    {"role": "system", "content": "You answer questions about the KV cache. " * 4},
    {"role": "user", "content": "Which prefill holds the longest prefix of this prompt?"},
]


class Stack:
    def __init__(self, project: ComposeProject, gateway: str, index: str) -> None:
        self.project = project
        self.gateway = gateway
        self.index = index

    def chat(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        body = {"model": "emulated-model", "messages": messages, "max_tokens": 8}
        response = httpx.post(f"{self.gateway}/v1/chat/completions", json=body, timeout=30)
        if response.status_code != 200:
            logs = self.project.run("logs", "--no-color", "--tail", "60", "gateway").stdout
            raise AssertionError(f"{response.status_code} {response.text}\n{logs}")
        answer: dict[str, Any] = response.json()
        return answer


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    command = compose_or_skip()
    build_s = build_image()
    ports = {name: free_port() for name in ("GATEWAY", "INDEX", "METRICS")}
    env = {f"GLOBALKV_PUBLISHED_{name}_PORT": str(port) for name, port in ports.items()}
    project = ComposeProject(
        command,
        name=f"globalkv-test-{os.getpid()}",
        env={**env, "GLOBALKV_ADMIN_TOKEN": ADMIN_TOKEN},
    )
    try:
        started = time.monotonic()
        project.up()
        project.wait_healthy(SERVICES, timeout=300)
        up_s = time.monotonic() - started
        print(f"\ncompose: image built in {build_s:.0f} s, every service healthy in {up_s:.0f} s")
        yield Stack(
            project, f"http://127.0.0.1:{ports['GATEWAY']}", f"http://127.0.0.1:{ports['INDEX']}"
        )
    finally:
        project.down()


def test_a_chat_twice_reuses_the_prefix_and_the_index_knows_where(stack: Stack) -> None:
    # Healthy is not yet routed by the index: the gateway registers each prefill with it
    # once the engine answers, and until then it routes by load, anywhere.
    def followed() -> bool:
        pods = httpx.get(f"{stack.index}/v1/pods", timeout=5).json()["pods"]
        return {pod["id"] for pod in pods} >= {"prefill-0", "prefill-1"}

    wait_for(followed, timeout=60, what="the index to follow both prefills")
    first = stack.chat(MESSAGES)
    assert first["choices"][0]["message"]["content"]
    second = stack.chat(MESSAGES)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0, second["usage"]

    token_ids = ByteTokenizer().apply_chat_template(MESSAGES)
    body = {"model": "emulated-model", "token_ids": token_ids}

    def indexed() -> bool:
        auth = {"authorization": f"Bearer {ADMIN_TOKEN}"}  # lookups are tenants' data
        answer = httpx.post(f"{stack.index}/v1/lookup", json=body, headers=auth, timeout=5).json()
        return bool(answer["pods"]) and answer["pods"][0]["hit_tokens"] >= cached

    wait_for(indexed, timeout=30, what="the index to hold the chat's prefix")


def test_the_image_runs_the_gateways_request_path_compiled(stack: Stack) -> None:
    """`docker build .` compiles what `[tool.globalkv.compile]` lists (docs/compiled.md):
    inside the gateway's container each of those modules is imported from its extension."""
    script = (
        "import importlib, sys\n"
        "for path in sys.argv[1:]:\n"
        "    module = importlib.import_module(path.removesuffix('.py').replace('/', '.'))\n"
        "    print(path, module.__file__)\n"
    )
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["globalkv"]
    modules = listed["compile"]["modules"]
    found = stack.project.run("exec", "-T", "gateway", "python", "-c", script, *modules).stdout
    imported = dict(line.split(" ", 1) for line in found.splitlines())
    assert sorted(imported) == sorted(modules)
    interpreted = [path for path, file in imported.items() if not file.endswith(".so")]
    assert not interpreted, f"imported from their sources in the image: {interpreted}"


def test_doctor_inside_the_compose_network_finds_a_healthy_cluster(stack: Stack) -> None:
    result = stack.project.run(
        "run",
        "--rm",
        "--no-deps",
        "gateway",
        "doctor",
        "--gateway",
        "http://gateway:30000",
        "--indexer",
        "http://indexer:8100",
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "✓ answer: 200" in result.stdout, result.stdout


def test_changes_through_the_published_ports_need_the_token_from_the_variable(
    stack: Stack,
) -> None:
    """Published ports reach the containers from the Docker bridge, not loopback: every
    guard wants the token, the one GLOBALKV_ADMIN_TOKEN gave them, and none warns of the
    file's default."""
    auth = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    pod = {"id": "intruder", "kv_events": {"endpoint": "tcp://10.0.0.1:5557"}}
    assert httpx.post(f"{stack.index}/v1/pods", json=pod, timeout=5).status_code == 401
    gone = httpx.delete(f"{stack.index}/v1/pods/nobody", headers=auth, timeout=5)
    assert gone.status_code == 404
    worker = {"url": "http://10.0.0.1:1", "role": "decode"}
    assert httpx.post(f"{stack.gateway}/workers", json=worker, timeout=5).status_code == 401
    gone = httpx.delete(f"{stack.gateway}/workers/nobody:1", headers=auth, timeout=5)
    assert gone.status_code == 404
    logs = stack.project.run("logs", "--no-color", "indexer", "gateway", "prefill-0").stdout
    assert "docker-compose.yml's default" not in logs


def test_requests_keep_succeeding_after_a_prefill_container_is_killed(stack: Stack) -> None:
    stack.project.run("kill", "prefill-0")
    assert stack.project.health()["prefill-0"] != "healthy"
    for i in range(20):
        messages = [{"role": "user", "content": f"Request {i} after prefill-0 was killed."}]
        answer = stack.chat(messages)
        assert answer["choices"][0]["message"]["content"]
    logs = stack.project.run("logs", "--no-color", "gateway", "decode-0", "decode-1").stdout
    assert "Traceback" not in logs, logs
