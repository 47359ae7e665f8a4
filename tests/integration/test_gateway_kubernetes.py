"""The gateway following Kubernetes pods, end to end: real gateway, indexer and emulated
engine processes, pods served by the in-process API stand-in (tests/support/kube_api.py,
not a kube-apiserver), the gateway finding it through a kubeconfig as it would outside a
cluster.

Each engine listens on its own loopback address with the same port, as pods do on their
pod IPs behind one `--service-discovery-port`. Under a steady load of requests, pods
appear (pending first, then Ready), the API server restarts, pods are deleted and their
engines stopped once the gateway let go of them: no request fails, and the prefills the
gateway discovered are registered with the indexer, so prefix routing finds their caches.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.kube_api import FakeKubeApi, pod
from tests.support.net import await_for, free_port
from tests.support.procs import Proc

pytestmark = pytest.mark.integration

MODEL = "k8s-model"
PAGE = 16
ENGINE_PORT = free_port()
"""Every engine's HTTP port, each on its own loopback address: `--service-discovery-port`."""
FAST = ("--prefill-tokens-per-s", "500000", "--prefill-overhead-ms", "1")
LABELS = {"prefill": {"app": "gkv", "role": "prefill"}, "decode": {"app": "gkv", "role": "decode"}}


@dataclass
class Engine:
    name: str
    role: str
    ip: str
    proc: Proc
    bootstrap_port: int | None

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{ENGINE_PORT}"

    def pod(self, *, ready: bool = True) -> dict[str, Any]:
        annotations = None
        if self.bootstrap_port is not None:
            annotations = {"sglang.ai/bootstrap-port": str(self.bootstrap_port)}
        return pod(self.name, LABELS[self.role], ip=self.ip, ready=ready, annotations=annotations)


def _engine(name: str, role: str, ip: str) -> Engine:
    argv = ["engine", "--role", role, "--host", ip, "--port", str(ENGINE_PORT)]
    argv += ["--model", MODEL, "--page-size", str(PAGE), *FAST, "--pod-id", name]
    bootstrap = None
    if role == "prefill":
        bootstrap = free_port()
        argv += ["--bootstrap-port", str(bootstrap), "--kv-events-endpoint", "tcp://*:0"]
        argv += ["--kv-events-replay-endpoint", "tcp://*:0", "--handshake-timeout", "3"]
    return Engine(name, role, ip, Proc.globalkv(*argv, name=name), bootstrap)


@dataclass
class Load:
    """Requests sent one after another by `lanes` loops until stopped; every answer kept."""

    url: str
    lanes: int = 2
    done: list[int] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        self.done = [0] * self.lanes
        async with httpx.AsyncClient(timeout=30) as client:
            await asyncio.gather(*(self._lane(client, lane) for lane in range(self.lanes)))

    async def _lane(self, client: httpx.AsyncClient, lane: int) -> None:
        while not self._stop.is_set():
            text = f"steady load {lane} {self.done[lane]}"
            body = {"text": text, "sampling_params": {"max_new_tokens": 2}}
            try:
                response = await client.post(f"{self.url}/generate", json=body)
                if response.status_code != 200:
                    self.failures.append(f"{response.status_code} {response.text[:200]}")
            except httpx.HTTPError as error:
                self.failures.append(repr(error))
            self.done[lane] += 1

    def stop(self) -> None:
        self._stop.set()

    async def settled(self) -> None:
        """Until every lane finished a request started after this call: none in flight
        then was sent before it."""
        marks = list(self.done)
        await until(lambda: all(d >= m + 2 for d, m in zip(self.done, marks, strict=True)))


async def until(condition: Callable[[], bool], what: str = "the load") -> None:
    async def holds() -> bool:
        return condition()

    await await_for(holds, timeout=30, what=what)


async def _workers(client: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
    answer = await client.get("/workers")
    return {w["url"]: w for w in answer.json()["workers"]}


async def _eventually(
    client: httpx.AsyncClient, check: Callable[[dict[str, dict[str, Any]]], bool]
) -> None:
    async def holds() -> bool:
        return check(await _workers(client))

    await await_for(holds, timeout=30, what="the workers discovery should have made")


def _healthy(*engines: Engine) -> Callable[[dict[str, dict[str, Any]]], bool]:
    wanted = {e.url for e in engines}

    def check(workers: dict[str, dict[str, Any]]) -> bool:
        ready = all(
            w["health"] == "healthy" and (w["role"] == "decode" or w["directory"] == "ready")
            for w in workers.values()
        )
        return set(workers) == wanted and ready

    return check


@contextlib.asynccontextmanager
async def _stack(tmp_path: Path) -> AsyncIterator[tuple[FakeKubeApi, dict[str, Engine], str, str]]:
    api = FakeKubeApi()
    await api.start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: fake\n"
        f"clusters: [{{name: fake, cluster: {{server: '{api.url}'}}}}]\n"
        "users: [{name: fake, user: {token: test}}]\n"
        "contexts: [{name: fake, context: {cluster: fake, user: fake, namespace: default}}]\n"
    )
    procs: list[Proc] = []
    try:
        indexer_port = free_port()
        indexer = Proc.globalkv(
            *("indexer", "--host", "127.0.0.1", "--port", str(indexer_port)),
            *("--block-size", str(PAGE), "--tokenizer", "byte"),
            name="indexer",
        )
        procs.append(indexer)
        engines = {
            name: _engine(name, role, ip)
            for name, role, ip in (
                ("prefill-0", "prefill", "127.0.0.11"),
                ("prefill-1", "prefill", "127.0.0.12"),
                ("decode-0", "decode", "127.0.0.21"),
                ("decode-1", "decode", "127.0.0.22"),
            )
        }
        procs += [e.proc for e in engines.values()]
        indexer_url = f"http://127.0.0.1:{indexer_port}"
        await asyncio.to_thread(indexer.wait_http, f"{indexer_url}/health")
        for engine in engines.values():
            await asyncio.to_thread(engine.proc.wait_http, f"{engine.url}/health")
        port = free_port()
        argv = ["gateway", "--pd-disaggregation", "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--prometheus-port", "0", "--service-discovery", "--service-discovery-port"]
        argv += [str(ENGINE_PORT), "--service-discovery-namespace", "default"]
        argv += ["--prefill-selector", "app=gkv", "role=prefill"]
        argv += ["--decode-selector", "app=gkv,role=decode"]
        argv += ["--indexer-url", indexer_url, "--model", MODEL, "--tokenizer", "byte"]
        argv += ["--worker-startup-check-interval", "0.1", "--directory-refresh-secs", "0.1"]
        gateway = Proc.globalkv(*argv, env={"KUBECONFIG": str(kubeconfig)}, name="gateway")
        procs.append(gateway)
        url = f"http://127.0.0.1:{port}"
        await asyncio.to_thread(gateway.wait_http, f"{url}/liveness")
        yield api, engines, url, indexer_url
    finally:
        for proc in reversed(procs):
            await asyncio.to_thread(proc.stop)
        await api.stop()


async def test_pods_come_and_go_under_load_without_a_failed_request(tmp_path: Path) -> None:
    async with (
        _stack(tmp_path) as (api, engines, url, indexer_url),
        httpx.AsyncClient(base_url=url, timeout=30) as admin,
    ):
        p0, p1, d0, d1 = (engines[n] for n in ("prefill-0", "prefill-1", "decode-0", "decode-1"))
        api.apply(p0.pod())
        api.apply(d0.pod())
        await _eventually(admin, _healthy(p0, d0))
        load = Load(url)
        running = asyncio.create_task(load.run())
        try:
            await until(lambda: sum(load.done) >= 10)
            api.apply(p1.pod(ready=False))
            api.apply(d1.pod(ready=False))
            await load.settled()
            assert set(await _workers(admin)) == {p0.url, d0.url}, "unready pods are no workers"
            api.apply(p1.pod())
            api.apply(d1.pod())
            await _eventually(admin, _healthy(p0, p1, d0, d1))
            await _routed_by_the_index(admin, indexer_url)

            await api.restart()
            await load.settled()
            api.delete("prefill-0")
            api.delete("decode-0")
            await _eventually(admin, _healthy(p1, d1))
            await load.settled()
            p0.proc.stop()
            d0.proc.stop()
            await load.settled()
        finally:
            load.stop()
            await running
        assert load.failures == []
        assert sum(load.done) >= 30


async def _routed_by_the_index(admin: httpx.AsyncClient, indexer_url: str) -> None:
    """The discovered prefills were registered with the indexer: the prefill a prompt went
    to is found holding it in the index, and repeats go there, their prefix cached."""
    prompt = "discovered prefills are indexed and routed to by prefix. " * 5
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 2}}
    first = await admin.post("/generate", json=body)
    assert first.status_code == 200, first.text
    lookup = {"model": MODEL, "text": prompt}
    async with httpx.AsyncClient(base_url=indexer_url, timeout=10) as indexer:

        async def indexed() -> bool:
            return bool((await indexer.post("/v1/lookup", json=lookup)).json()["pods"])

        await await_for(indexed, what="the prompt in the index")
        holders = (await indexer.post("/v1/lookup", json=lookup)).json()["pods"]
    assert {h["pod"] for h in holders} <= {"prefill-0", "prefill-1"}
    for _ in range(3):
        again = await admin.post("/generate", json=body)
        assert again.status_code == 200, again.text
        assert again.json()["meta_info"]["cached_tokens"] >= len(prompt) // PAGE * PAGE - PAGE
