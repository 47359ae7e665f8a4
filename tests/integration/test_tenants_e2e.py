"""LoRA adapters and cache salts end to end: emulated engines serving adapters, the
indexer, a gateway, each a real process on its own ports; and vLLM 0.33.0's own KV-event
bytes (`tests/data/kv_events`) published into a real indexer.

- vp-0, vp-1: vLLM prefills of `vl-model` serving adapters ad-a and ad-b, publishing in
  vLLM 0.33's shape; vp-2 serves no adapter; vd-0 their decode (both adapters).
- sp-0, sp-1: SGLang prefills of `sg-model` serving ad-a, publishing in SGLang 0.5.23's
  shape; sd-0 their decode.

A prefix is put on one prefill directly (as an earlier request routed elsewhere would),
then asked through the gateway: it must land there and be served from cache, and the same
tokens in any other namespace must count nothing, in the index or in the engine.
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from gateway.requests.namespace import ServedAdapter, request_namespace
from tests.support.metrics import scrape
from tests.support.net import free_port, wait_for
from tests.support.procs import Proc

pytestmark = pytest.mark.integration

VL, SG = "vl-model", "sg-model"
PAGE = 16
FAST = ("--prefill-tokens-per-s", "500000", "--prefill-overhead-ms", "1")
GOLDEN = Path(__file__).parent.parent / "data" / "kv_events" / "vllm-0.33.0.json"


@dataclass
class Cluster:
    engines: dict[str, str]
    gateway: str
    indexer: str
    golden_endpoint: str
    """The indexer's bound SUB that the golden batches are published into."""


def _engine_argv(name: str, port: int) -> list[str]:
    role = "prefill" if name[1] == "p" else "decode"
    argv = ["engine", "--role", role, "--port", str(port), "--page-size", str(PAGE), *FAST]
    if name.startswith("v"):
        argv += ["--api", "vllm", "--model", VL]
        argv += ["--lora-adapters", "ad-a,ad-b"] if name != "vp-2" else []
    else:
        argv += ["--model", SG, "--lora-adapters", "ad-a"]
    if role == "prefill":
        argv += ["--pod-id", name, "--decode-tokens-per-s", "2000"]
        argv += ["--bootstrap-port", "0", "--kv-events-endpoint", "tcp://*:0"]
        argv += ["--kv-events-format", "vllm" if name.startswith("v") else "sglang"]
    return argv


def _ready(cluster: Cluster) -> bool:
    url = f"{cluster.gateway}/workers"
    workers = httpx.get(url, timeout=5).json()["workers"]
    if not all(w["health"] == "healthy" and w["eligible"] and w["kind_detected"] for w in workers):
        return False
    if sum(bool(w["adapters"]) for w in workers) != 6:
        return False
    pods = httpx.get(f"{cluster.indexer}/v1/pods", timeout=5).json()["pods"]
    return sum(bool(p["state"] and p["state"]["subscribed"]) for p in pods) == 5


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    procs: list[Proc] = []
    names = ["vp-0", "vp-1", "vp-2", "vd-0", "sp-0", "sp-1", "sd-0"]
    try:
        indexer_port, golden_port = free_port(), free_port()
        golden_endpoint = f"tcp://127.0.0.1:{golden_port}"
        argv = ["indexer", "--host", "127.0.0.1", "--port", str(indexer_port)]
        argv += ["--block-size", str(PAGE), "--bind", golden_endpoint]
        procs.append(Proc.globalkv(*argv, name="indexer"))
        ports = {name: free_port() for name in names}
        urls = {name: f"http://127.0.0.1:{ports[name]}" for name in names}
        for name in names:
            procs.append(Proc.globalkv(*_engine_argv(name, ports[name]), name=name))
        for name, proc in zip(names, procs[1:], strict=True):
            proc.wait_http(f"{urls[name]}/health")
        indexer = f"http://127.0.0.1:{indexer_port}"
        procs[0].wait_http(f"{indexer}/health")
        port = free_port()
        argv = ["gateway", "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", "0"]
        for name in names:
            argv += ["--prefill" if name[1] == "p" else "--decode", urls[name]]
            if name.startswith("sp"):
                info = httpx.get(f"{urls[name]}/server_info", timeout=5).json()
                argv.append(str(info["disaggregation_bootstrap_port"]))
        argv += ["--indexer-url", indexer, "--tokenizer", "byte"]
        argv += ["--worker-startup-check-interval", "0.1", "--prefix-pending-grace-secs", "off"]
        gateway = Proc.globalkv(*argv, name="gateway")
        procs.append(gateway)
        gateway_url = f"http://127.0.0.1:{port}"
        gateway.wait_http(f"{gateway_url}/liveness")
        built = Cluster(urls, gateway_url, indexer, golden_endpoint)
        wait_for(lambda: _ready(built), timeout=40, what="workers, adapters and pods")
        yield built
    finally:
        for proc in reversed(procs):
            proc.stop()


def _tokens(pages: int) -> list[int]:
    rng = random.Random(uuid.uuid4().int)
    return [rng.randrange(1, 250) for _ in range(pages * PAGE)]


def _lookup(cluster: Cluster, model: str, tokens: list[int], **namespace: str) -> dict[str, int]:
    body = {"model": model, "token_ids": tokens, **namespace}
    pods = httpx.post(f"{cluster.indexer}/v1/lookup", json=body, timeout=5).json()["pods"]
    return {p["pod"]: p["hit_tokens"] for p in pods}


def _warm(cluster: Cluster, engine: str, body: dict[str, Any], prefix: list[int]) -> None:
    """`body` sent to `engine` directly, until the index shows its prefix there."""
    namespace = {k: v for k, v in body.items() if k in ("cache_salt",)}
    lora = body.get("lora_path") or (body["model"] if body["model"] in ("ad-a", "ad-b") else None)
    if isinstance(body["model"], str) and ":" in body["model"]:
        lora = body["model"].split(":", 1)[1]
    if lora is not None:
        namespace["lora_name"] = lora
    model = VL if engine.startswith("v") else SG

    def indexed() -> bool:
        poke = {**body, "prompt": [*prefix, *_tokens(1)], "max_tokens": 1}
        url = f"{cluster.engines[engine]}/v1/completions"
        assert httpx.post(url, json=poke, timeout=10).status_code == 200
        return _lookup(cluster, model, prefix, **namespace).get(engine) == len(prefix)

    wait_for(indexed, timeout=20, what=f"{engine} holding the prefix in the index")


def _complete(cluster: Cluster, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{cluster.gateway}/v1/completions", json=body, timeout=30)


def _cached(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    cached: int = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached


def test_the_gateway_learns_each_worker_s_adapters(cluster: Cluster) -> None:
    workers = httpx.get(f"{cluster.gateway}/workers", timeout=5).json()["workers"]
    adapters = {w["url"]: w["adapters"] for w in workers}
    engines = cluster.engines
    assert adapters[engines["vp-0"]] == ["ad-a", "ad-b"]
    assert adapters[engines["vp-2"]] == []
    assert adapters[engines["sd-0"]] == ["ad-a"]


def test_a_vllm_lora_prompt_lands_on_the_pod_holding_its_prefix(cluster: Cluster) -> None:
    prefix = _tokens(4)
    _warm(cluster, "vp-1", {"model": "ad-a"}, prefix)
    assert "vp-1" not in _lookup(cluster, VL, prefix)
    assert "vp-1" not in _lookup(cluster, VL, prefix, lora_name="ad-b")
    prompt = [*prefix, *_tokens(1)]
    assert _cached(_complete(cluster, {"model": "ad-a", "prompt": prompt, "max_tokens": 2})) == 64
    # the same tokens for the base model or the other adapter share nothing
    for model in (VL, "ad-b"):
        body = {"model": model, "prompt": [*prefix, *_tokens(1)], "max_tokens": 2}
        assert _cached(_complete(cluster, body)) == 0


def test_an_adapter_request_goes_only_to_pods_serving_it(cluster: Cluster) -> None:
    def served() -> float:
        labels = {"endpoint": "/v1/completions", "outcome": "ok"}
        return scrape(cluster.engines["vp-2"], "globalkv_engine_requests_total", **labels)

    before = served()
    for _ in range(6):
        body = {"model": "ad-b", "prompt": _tokens(2), "max_tokens": 1}
        assert _complete(cluster, body).status_code == 200
    assert served() == before
    unknown = _complete(cluster, {"model": f"{SG}:ad-z", "prompt": _tokens(1)})
    assert unknown.status_code == 404
    assert "ad-z" in unknown.json()["error"]["message"]


def test_a_salted_tenant_hits_only_its_own_salt(cluster: Cluster) -> None:
    prefix = _tokens(4)
    _warm(cluster, "vp-0", {"model": VL, "cache_salt": "tenant-1"}, prefix)
    assert "vp-0" not in _lookup(cluster, VL, prefix)
    assert "vp-0" not in _lookup(cluster, VL, prefix, cache_salt="tenant-2")
    body = {"model": VL, "prompt": [*prefix, *_tokens(1)], "max_tokens": 2}
    assert _cached(_complete(cluster, {**body, "cache_salt": "tenant-1"})) == 64
    assert _cached(_complete(cluster, {**body, "cache_salt": "tenant-2"})) == 0


def test_an_sglang_lora_prompt_lands_on_the_pod_holding_its_prefix(cluster: Cluster) -> None:
    prefix = _tokens(4)
    _warm(cluster, "sp-1", {"model": SG, "lora_path": "ad-a", "cache_salt": "s"}, prefix)
    assert "sp-1" not in _lookup(cluster, SG, prefix, lora_name="ad-a")
    body = {"prompt": [*prefix, *_tokens(1)], "max_tokens": 2, "cache_salt": "s"}
    assert _cached(_complete(cluster, {**body, "model": f"{SG}:ad-a"})) == 64
    assert _cached(_complete(cluster, {**body, "model": SG})) == 0


def test_vllm_0_33_event_bytes_key_each_namespace_apart(cluster: Cluster) -> None:
    """vLLM's own batches, published as a vLLM engine connecting to a bound indexer SUB
    would, looked up under the namespaces the gateway derives from requests."""
    golden = json.loads(GOLDEN.read_text())
    model, prompt = golden["model"], golden["prompt"]
    topic = f"kv@golden-pod@{model}".encode()
    batches = [
        bytes.fromhex(b)
        for case in ("lora", "salt", "lora_salt", "salt_two_steps")
        for b in golden["cases"][case]["batches"]
    ]
    context = zmq.Context()
    pub = context.socket(zmq.XPUB)  # a PUB that shows the subscription it got
    pub.setsockopt(zmq.LINGER, 0)
    try:
        pub.connect(cluster.golden_endpoint)
        assert pub.poll(20_000), "the indexer's SUB never subscribed"
        pub.recv()
        for seq, payload in enumerate(batches):
            pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
        last = [*prompt, *golden["tail"]]
        wait_for(
            lambda: bool(_lookup(cluster, model, last, cache_salt="tenant-2")),
            timeout=20,
            what="the golden batches in the index",
        )
    finally:
        pub.close()
        context.term()
    # the adapter on a vLLM and an SGLang worker: either naming reaches the same namespace
    adapters = {
        ServedAdapter("adapter-a", model, "vllm"),
        ServedAdapter("adapter-a", model, "sglang"),
    }
    models = {model}

    def hit(body: dict[str, Any], tokens: list[int]) -> int:
        namespace = request_namespace(body, adapters, models)
        found = _lookup(
            cluster,
            model,
            tokens,
            **{
                k: v
                for k, v in (
                    ("lora_name", namespace.lora_name),
                    ("cache_salt", namespace.cache_salt),
                )
                if v is not None
            },
        )
        return found.get("golden-pod", 0)

    assert hit({"model": "adapter-a"}, prompt) == 64  # vLLM naming
    assert hit({"model": f"{model}:adapter-a"}, prompt) == 64  # SGLang naming, same namespace
    assert hit({"model": model, "cache_salt": "tenant-1"}, prompt) == 64
    assert hit({"model": "adapter-a", "cache_salt": "tenant-1"}, prompt) == 64
    assert hit({"model": model}, prompt) == 0
    assert hit({"model": model, "cache_salt": "tenant-9"}, prompt) == 0
    both = [*prompt, *golden["tail"]]
    assert hit({"model": model, "cache_salt": "tenant-2"}, both) == 96
