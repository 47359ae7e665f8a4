"""docker-compose.yml's services run as local processes through the containers' own
configuration path, and a request is routed through them.

Each globalkv service is started as `python -m globalkv <its command>` with its compose
environment, localized (`tests.stack.compose`: service hosts → 127.0.0.1, every
(service, port) → one free port); Redis is a throw-away redis-server. Services start in
`depends_on` waves, each waiting for its own health check to pass, and the health-check
commands themselves are run as written. Then every exposed port must be listening, and
requests through the gateway must work, reuse the prefix cache and show in the index.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from globalkv.stack.healthcheck import problem
from globalkv.stack.plan import reserve_ports
from kvplumbing.auth import PUBLISHED_DEFAULT_TOKEN
from tests.stack.compose import LOCAL, ROOT, load, localize, start_order
from tests.support.net import wait_for
from tests.support.procs import Proc

pytestmark = pytest.mark.integration

PROMPT = "Compose runs the same services as these processes. " * 6


class LocalStack:
    def __init__(self, redis_url: str) -> None:
        self.services = load()
        wanted = [(n, p) for n, s in self.services.items() if s.is_globalkv for p in s.expose]
        self.ports = dict(zip(wanted, reserve_ports(len(wanted)), strict=True))
        self.ports[("redis", 6379)] = int(urlsplit(redis_url).port or 0)
        self.procs: dict[str, Proc] = {}

    def url(self, service: str, port: int) -> str:
        return f"http://{LOCAL}:{self.ports[(service, port)]}"

    def start(self) -> None:
        for wave in start_order(self.services):
            started = [name for name in wave if self.services[name].is_globalkv]
            checks = {}
            for name in started:
                service = self.services[name]
                env, check = localize(service, self.services, self.ports)
                assert check is not None
                checks[name] = check
                self.procs[name] = Proc.globalkv(*service.command, env=env, name=name)
            for name in started:
                self._wait_healthy(name, checks[name])

    def _wait_healthy(self, name: str, check: list[str]) -> None:
        proc = self.procs[name]
        urls = check[3:]

        def healthy() -> bool:
            if not proc.alive():
                raise RuntimeError(f"{name} exited:\n{proc.log()}")
            return all(problem(url, timeout=1.0) is None for url in urls)

        try:
            wait_for(healthy, timeout=60, what=f"{name}'s health check")
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\n--- {name} log ---\n{proc.log()}") from None
        assert check[0] == "python"
        result = subprocess.run(
            [sys.executable, *check[1:]], cwd=ROOT, capture_output=True, text=True, timeout=30
        )
        assert result.returncode == 0, f"{name}'s health check command: {result.stderr}"

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            proc.stop()


@pytest.fixture
def stack(redis_url: str) -> Iterator[LocalStack]:
    local = LocalStack(redis_url)
    try:
        local.start()
        yield local
    finally:
        local.stop()


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(2)
        return sock.connect_ex((LOCAL, port)) == 0


def test_compose_services_serve_requests_as_local_processes(stack: LocalStack) -> None:
    for (name, port), local in stack.ports.items():
        assert _listening(local), f"{name} does not listen on its exposed port {port}"

    gateway = stack.url("gateway", 30000)
    indexer = stack.url("indexer", 8100)
    with httpx.Client(timeout=30) as client:
        body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 4}}
        first = client.post(f"{gateway}/generate", json=body)
        assert first.status_code == 200, first.text
        assert first.json()["meta_info"]["cached_tokens"] == 0

        lookup = {"model": "emulated-model", "text": PROMPT}
        auth = {"authorization": f"Bearer {PUBLISHED_DEFAULT_TOKEN}"}  # lookups are guarded

        def indexed() -> bool:
            answer = client.post(f"{indexer}/v1/lookup", json=lookup, headers=auth)
            return answer.status_code == 200 and bool(answer.json()["pods"])

        wait_for(indexed, timeout=20, what="the prompt's blocks in the Redis index")
        (holder,) = client.post(f"{indexer}/v1/lookup", json=lookup, headers=auth).json()["pods"]
        assert holder["pod"] in {"prefill-0", "prefill-1"}
        assert holder["hit_tokens"] >= 16 * 10

        again = client.post(f"{gateway}/generate", json=body)
        assert again.status_code == 200, again.text
        assert again.json()["meta_info"]["cached_tokens"] >= holder["hit_tokens"]

        chat = {
            "model": "emulated-model",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 4,
            "stream": True,
        }
        streamed = client.post(f"{gateway}/v1/chat/completions", json=chat)
        assert streamed.status_code == 200
        assert streamed.text.rstrip().endswith("data: [DONE]")

        metrics = client.get(f"{stack.url('gateway', 29000)}/metrics")
        assert metrics.status_code == 200
        assert "globalkv_gateway_requests_total" in metrics.text
    _changes_need_the_files_token_and_every_guard_warns(stack)


def _changes_need_the_files_token_and_every_guard_warns(stack: LocalStack) -> None:
    """Here the clients are on loopback, and still refused: the compose file gives every
    guard a token, which without GLOBALKV_ADMIN_TOKEN is its published default."""
    auth = {"authorization": f"Bearer {PUBLISHED_DEFAULT_TOKEN}"}
    gateway, indexer = stack.url("gateway", 30000), stack.url("indexer", 8100)
    directory = stack.url("prefill-0", 8998)
    with httpx.Client(timeout=10) as client:
        assert client.delete(f"{gateway}/workers/nobody:1").status_code == 401
        assert client.delete(f"{gateway}/workers/nobody:1", headers=auth).status_code == 404
        assert client.delete(f"{indexer}/v1/pods/nobody").status_code == 401
        assert client.delete(f"{indexer}/v1/pods/nobody", headers=auth).status_code == 404
        assert client.delete(f"{directory}/v1/directory").status_code == 401
        assert client.get(f"{gateway}/workers", headers=auth).status_code == 200
    for name in ("indexer", "prefill-0", "gateway"):
        assert "docker-compose.yml's default" in stack.procs[name].log(), name
