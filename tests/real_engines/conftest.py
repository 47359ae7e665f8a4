"""Real vLLM CPU engines, an indexer and a gateway, started once for the module.

The engines run under the interpreter `engines.vllm_python` finds (GLOBALKV_VLLM_PYTHON,
else the environment `bash .ci/real-engines` makes); where there is none the module is
skipped saying so, and the main suite pays only this check.

The stack, in the order a new user would meet it:
- prefill-0 binds its KV-event PUB (the indexer connects: connect mode), prefill-1
  connects its PUB to the indexer's bound SUB (bind mode); both keep a replay buffer and
  store each prompt's KV under ExampleConnector's shared storage; decode-0 loads it from
  there (`kv_consumer`) and publishes no events;
- before any indexer listens, each prefill computes one prompt (`Stack.before`): its
  events go nowhere, so only the engines' replay buffers hold them;
- then the indexer (`--bind`) and the gateway, which registers both prefills from what
  vLLM serves (`/kv_event_sources`, `/metrics`), with no pod given by hand.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from globalkv.tokenize import load_tokenizer
from kvplumbing.ports import unclaimed_ports
from tests.real_engines.engines import Engine, event_config, shared_storage, start_all
from tests.real_engines.model import MODEL, write_model
from tests.real_engines.prompts import Prompts
from tests.support.net import wait_for
from tests.support.procs import Proc

INDEX_BLOCK_SIZE = 16
"""The index's block size: it divides the engines' 32, as it must."""


@dataclass
class Stack:
    prefills: tuple[Engine, Engine]
    decode: Engine
    indexer: Proc
    indexer_url: str
    gateway: Proc
    gateway_url: str
    prompts: Prompts
    before: dict[str, tuple[str, dict[str, Any]]]
    """Engine name → the prompt it computed before the indexer started, and its answer."""
    started: float
    """time.monotonic() when the module began starting engines."""

    def engine(self, name: str) -> Engine:
        return next(e for e in (*self.prefills, self.decode) if e.name == name)

    def lookup(self, token_ids: list[int]) -> dict[str, int]:
        """Pod → the prompt's tokens the index says it holds."""
        body = {"model": MODEL, "token_ids": token_ids}
        response = httpx.post(f"{self.indexer_url}/v1/lookup", json=body, timeout=10)
        response.raise_for_status()
        return {hit["pod"]: hit["hit_tokens"] for hit in response.json()["pods"]}

    def gateway_metric(self, name: str, **labels: str) -> float:
        return _metric(f"{self.gateway_url}/metrics", name, labels)

    def indexer_metric(self, name: str, **labels: str) -> float:
        return _metric(f"{self.indexer_url}/metrics", name, labels)


def _pods(indexer_url: str) -> set[str]:
    response = httpx.get(f"{indexer_url}/v1/pods", timeout=10)
    assert response.status_code == 200, response.text
    return {pod["id"] for pod in response.json()["pods"]}


def _metric(url: str, name: str, labels: dict[str, str]) -> float:
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                total += sample.value
    return total


@pytest.fixture(scope="module")
def stack(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    started = time.monotonic()
    model_dir = write_model(tmp_path_factory.mktemp("model"))
    storage = tmp_path_factory.mktemp("kv")
    port = iter(unclaimed_ports(9))
    bound = f"tcp://127.0.0.1:{next(port)}"
    prefill_0 = Engine(
        "prefill-0",
        next(port),
        events=event_config("prefill-0", f"tcp://*:{next(port)}", next(port)),
        transfer=shared_storage("kv_producer", storage),
    )
    prefill_1 = Engine(
        "prefill-1",
        next(port),
        events=event_config("prefill-1", bound, next(port)),
        transfer=shared_storage("kv_producer", storage),
    )
    decode = Engine("decode-0", next(port), transfer=shared_storage("kv_consumer", storage))
    engines = [prefill_0, prefill_1, decode]
    prompts = Prompts(load_tokenizer(str(model_dir)))
    start_all(engines, vllm_python, model_dir)
    procs: list[Proc] = []
    try:
        before = {}
        for engine in (prefill_0, prefill_1):
            prompt = prompts.new(90)
            before[engine.name] = (prompt, engine.complete(prompt))
        indexer_url = f"http://127.0.0.1:{next(port)}"
        indexer = Proc.globalkv(
            "indexer",
            "--host",
            "127.0.0.1",
            "--port",
            indexer_url.rsplit(":", 1)[1],
            "--bind",
            bound,
            "--block-size",
            str(INDEX_BLOCK_SIZE),
            name="indexer",
        )
        procs.append(indexer)
        indexer.wait_http(f"{indexer_url}/health")
        assert indexer.alive(), f"the indexer's port was taken:\n{indexer.log()}"
        gateway_url = f"http://127.0.0.1:{next(port)}"
        gateway = Proc.globalkv(
            "gateway",
            "--host",
            "127.0.0.1",
            "--port",
            gateway_url.rsplit(":", 1)[1],
            "--prometheus-port",
            "0",
            "--vllm-prefill",
            prefill_0.url,
            "--vllm-prefill",
            prefill_1.url,
            "--vllm-decode",
            decode.url,
            "--indexer-url",
            indexer_url,
            "--tokenizer",
            str(model_dir),
            "--model",
            MODEL,
            "--block-size",
            str(INDEX_BLOCK_SIZE),
            name="gateway",
        )
        procs.append(gateway)
        gateway.wait_http(f"{gateway_url}/health")
        try:
            wait_for(lambda: _pods(indexer_url) == {"prefill-0", "prefill-1"}, timeout=60)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}: the gateway registered no pods\n{gateway.log()}") from None
        yield Stack(
            (prefill_0, prefill_1),
            decode,
            indexer,
            indexer_url,
            gateway,
            gateway_url,
            prompts,
            before,
            started,
        )
    finally:
        for proc in reversed(procs):
            proc.stop()
        for engine in engines:
            engine.stop()


@pytest.fixture(scope="module")
def vllm_python() -> str:
    from tests.real_engines.engines import vllm_python as find

    found = find()
    if isinstance(found, Path):
        return str(found)
    pytest.skip(found)
