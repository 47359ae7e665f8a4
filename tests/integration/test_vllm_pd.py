"""vLLM prefill/decode through the gateway, end to end: emulated engines speaking vLLM's
NIXL-connector protocol (`globalkv engine --api vllm`), an SGLang pool beside them, the
indexer and several gateways, each a real process on its own ports.

- vp-0, vp-1: vLLM prefills of model `vl-model` publishing KV events in vLLM's wire shape;
  vd-0 their decode; vp-bad and vd-bad fail every request; vp-eos ends every prefill on
  EOS (so it answers without `kv_transfer_params`); vp-short holds its blocks 0.3 s.
- sp-0, sd-0: an SGLang pair of model `sg-model`.
- The `mixed` gateway is given every healthy worker with `--prefill`/`--decode` only, so
  the kinds are detected, and no `--model`, so each pool is keyed in the index by its own
  model; it routes vLLM's prefill by the index; the other gateways
  each isolate one failure (`--vllm-prefill`/`--vllm-decode`, kinds given).

The decode refuses a pull whose `remote_request_id` was not made from its own
`X-Request-Id`, so every successful pull shows one request id on both legs.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.support.metrics import scrape
from tests.support.net import free_port, wait_for
from tests.support.procs import Proc

pytestmark = pytest.mark.integration

VL, SG = "vl-model", "sg-model"
PAGE = 16
FAST = ("--prefill-tokens-per-s", "500000", "--prefill-overhead-ms", "1")
GATEWAYS = ("mixed", "prefill-faults", "decode-faults", "eos", "strict", "recompute")


@dataclass
class Cluster:
    engines: dict[str, str]
    """Engine name → URL."""
    gateways: dict[str, str]
    indexer: str

    def workers(self, gateway: str) -> dict[str, dict[str, Any]]:
        listed = httpx.get(f"{self.gateways[gateway]}/workers", timeout=5).json()["workers"]
        return {w["url"]: w for w in listed}

    def metric(self, where: str, name: str, **labels: str) -> float:
        return scrape(self.gateways.get(where) or self.engines[where], name, **labels)


def _engine_argv(name: str, port: int) -> list[str]:
    role = "prefill" if name[1] == "p" else "decode"
    argv = ["engine", "--role", role, "--port", str(port), "--page-size", str(PAGE), *FAST]
    argv += ["--decode-tokens-per-s", "2000", "--pod-id", name] if role == "prefill" else []
    if name.startswith("v"):
        argv += ["--api", "vllm", "--model", VL]
        if role == "prefill":
            hold = "0.3" if name == "vp-short" else "10"
            argv += ["--kv-events-format", "vllm", "--handshake-timeout", hold]
    else:
        argv += ["--model", SG]
    if role == "prefill":
        argv += ["--bootstrap-port", "0", "--kv-events-endpoint", "tcp://*:0"]
        argv += ["--kv-events-replay-endpoint", "tcp://*:0"]
    if name.endswith("-bad"):
        argv += ["--fault-fail-rate", "1"]
    if name == "vp-eos":
        argv += ["--fault-eos-rate", "1"]
    return argv


def _gateway_argv(name: str, urls: dict[str, str], indexer: str) -> list[str]:
    common = ["--tokenizer", "byte", "--worker-startup-check-interval", "0.1"]
    common += ["--retry-initial-backoff-ms", "1", "--retry-max-backoff-ms", "5"]
    if name == "mixed":
        info = httpx.get(f"{urls['sp-0']}/server_info", timeout=5).json()
        argv = ["--prefill", urls["vp-0"], "--prefill", urls["vp-1"], "--decode", urls["vd-0"]]
        argv += ["--prefill", urls["sp-0"], str(info["disaggregation_bootstrap_port"])]
        argv += ["--decode", urls["sd-0"], "--indexer-url", indexer]
        argv += ["--decode-policy", "round_robin", "--prefix-pending-grace-secs", "off"]
        return [*argv, *common]
    pairs = {
        "prefill-faults": (["vp-bad", "vp-0"], ["vd-0"]),
        "decode-faults": (["vp-0"], ["vd-bad", "vd-0"]),
        "eos": (["vp-eos"], ["vd-0"]),
        "strict": (["vp-bad"], ["vd-0"]),
        "recompute": (["vp-bad"], ["vd-0"]),
    }
    prefills, decodes = pairs[name]
    argv = [arg for p in prefills for arg in ("--vllm-prefill", urls[p])]
    argv += [arg for d in decodes for arg in ("--vllm-decode", urls[d])]
    attempts = "2" if prefills == ["vp-bad"] else "4"
    argv += ["--policy", "round_robin", "--retry-max-retries", attempts]
    if name == "recompute":
        argv.append("--vllm-allow-recompute")
    return [*argv, *common]


def _ready(cluster: Cluster) -> bool:
    for gateway in cluster.gateways:
        workers = cluster.workers(gateway).values()
        if not all(w["health"] == "healthy" and w["eligible"] for w in workers):
            return False
        if gateway == "mixed" and not all(w["kind_detected"] for w in workers):
            return False
    pods = httpx.get(f"{cluster.indexer}/v1/pods", timeout=5).json()["pods"]
    return sum(bool(p["state"] and p["state"]["subscribed"]) for p in pods) == 3


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    procs: list[Proc] = []

    def spawn(*argv: str, name: str) -> Proc:
        proc = Proc.globalkv(*argv, name=name)
        procs.append(proc)
        return proc

    names = ["vp-0", "vp-1", "vp-bad", "vp-eos", "vp-short", "vd-0", "vd-bad", "sp-0", "sd-0"]
    try:
        indexer_port = free_port()
        indexer_proc = spawn(
            *("indexer", "--host", "127.0.0.1", "--port", str(indexer_port)),
            *("--block-size", str(PAGE)),
            name="indexer",
        )
        ports = {name: free_port() for name in names}
        started = {name: spawn(*_engine_argv(name, ports[name]), name=name) for name in names}
        urls = {name: f"http://127.0.0.1:{ports[name]}" for name in names}
        for name, proc in started.items():
            proc.wait_http(f"{urls[name]}/health")
        indexer = f"http://127.0.0.1:{indexer_port}"
        indexer_proc.wait_http(f"{indexer}/health")
        gateways: dict[str, str] = {}
        for name in GATEWAYS:
            port = free_port()
            argv = ["gateway", "--host", "127.0.0.1", "--port", str(port)]
            argv += ["--prometheus-port", "0", *_gateway_argv(name, urls, indexer)]
            spawn(*argv, name=f"gateway-{name}")
            gateways[name] = f"http://127.0.0.1:{port}"
        for proc, url in zip(procs[-len(GATEWAYS) :], gateways.values(), strict=True):
            proc.wait_http(f"{url}/liveness")
        built = Cluster(urls, gateways, indexer)
        wait_for(lambda: _ready(built), timeout=40, what="gateways, kinds and pods")
        yield built
    finally:
        for proc in reversed(procs):
            proc.stop()


def _complete(
    cluster: Cluster, gateway: str, prompt: Any, model: str = VL, **fields: Any
) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 4, **fields}
    return httpx.post(f"{cluster.gateways[gateway]}/v1/completions", json=body, timeout=30)


def _tokens(pages: int) -> list[int]:
    """A fresh prompt of `pages` full pages of token ids."""
    rng = random.Random(uuid.uuid4().int)
    return [rng.randrange(1, 250) for _ in range(pages * PAGE)]


def test_kinds_and_models_are_detected_from_the_workers(cluster: Cluster) -> None:
    workers = cluster.workers("mixed")
    engines = cluster.engines.items()
    kinds = {name: workers[url]["kind"] for name, url in engines if url in workers}
    vllm, sglang = ["vp-0", "vp-1", "vd-0"], ["sp-0", "sd-0"]
    assert kinds == {**dict.fromkeys(vllm, "vllm"), **dict.fromkeys(sglang, "sglang")}
    assert workers[cluster.engines["sd-0"]]["served_model"] == SG
    given = cluster.workers("prefill-faults")
    assert {w["kind"] for w in given.values()} == {"vllm"}
    assert not any(w["kind_detected"] for w in given.values())


def test_a_completion_goes_through_prefill_then_decode(cluster: Cluster) -> None:
    computed = cluster.metric("vd-0", "globalkv_engine_vllm_recomputed_prompts_total")
    response = _complete(cluster, "mixed", _tokens(3))
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["model"] == VL
    assert answer["usage"]["completion_tokens"] == 4
    assert answer["kv_transfer_params"] is None  # the decode's answer, not the prefill's
    assert cluster.metric("vd-0", "globalkv_engine_vllm_recomputed_prompts_total") == computed


def test_a_stream_carries_the_decodes_tokens_and_usage(cluster: Cluster) -> None:
    body = {
        "model": VL,
        "messages": [{"role": "user", "content": f"stream {uuid.uuid4().hex}"}],
        "max_tokens": 6,
        "min_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    url = f"{cluster.gateways['mixed']}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        request_id = response.headers["x-request-id"]
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert request_id.startswith("chatcmpl-"), "the gateway's request id, sent to both legs"
    assert events[-1] == "data: [DONE]"
    assert '"completion_tokens": 6' in events[-2]


def test_the_index_sends_a_shared_prefix_to_the_vllm_prefill_holding_it(
    cluster: Cluster,
) -> None:
    prefix = _tokens(4)
    vp1 = cluster.engines["vp-1"]

    def indexed() -> bool:
        poke = [*prefix, *_tokens(1)]
        warm = {"prompt": poke, "max_tokens": 1, "model": VL}
        assert httpx.post(f"{vp1}/v1/completions", json=warm, timeout=10).status_code == 200
        lookup = {"model": VL, "token_ids": prefix}
        pods = httpx.post(f"{cluster.indexer}/v1/lookup", json=lookup, timeout=5).json()["pods"]
        return any(p["pod"] == "vp-1" and p["hit_tokens"] == 4 * PAGE for p in pods)

    wait_for(indexed, timeout=20, what="vp-1 holding the prefix in the index")
    response = _complete(cluster, "mixed", [*prefix, *_tokens(1)])
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * PAGE


def test_another_model_is_served_by_the_sglang_pool_of_the_same_gateway(
    cluster: Cluster,
) -> None:
    served = cluster.metric("sd-0", "globalkv_engine_requests_total", outcome="ok")
    vllm_served = cluster.metric("vd-0", "globalkv_engine_requests_total", outcome="ok")
    response = _complete(cluster, "mixed", _tokens(2), model=SG)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == SG
    assert cluster.metric("sd-0", "globalkv_engine_requests_total", outcome="ok") == served + 1
    assert cluster.metric("vd-0", "globalkv_engine_requests_total", outcome="ok") == vllm_served


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_failed_leg_is_retried_on_another_worker(cluster: Cluster, role: str) -> None:
    """Round robin puts the failing worker first on at least every other request; each
    failure is retried, and every request is answered."""
    gateway, bad = f"{role}-faults", f"v{role[0]}-bad"
    retries = cluster.metric(gateway, "globalkv_gateway_retries_total", role=role)
    failed = cluster.metric(bad, "globalkv_engine_requests_total", outcome="error")
    computed = cluster.metric("vd-0", "globalkv_engine_vllm_recomputed_prompts_total")
    for i in range(4):
        response = _complete(cluster, gateway, _tokens(2), stream=i % 2 == 1)
        assert response.status_code == 200, response.text
    retried = cluster.metric(gateway, "globalkv_gateway_retries_total", role=role) - retries
    failures = cluster.metric(bad, "globalkv_engine_requests_total", outcome="error") - failed
    assert retried == failures >= 2
    assert cluster.metric("vd-0", "globalkv_engine_vllm_recomputed_prompts_total") == computed


def test_a_prefill_ending_on_eos_has_the_decode_recompute(cluster: Cluster) -> None:
    counted = cluster.metric("eos", "globalkv_gateway_vllm_recomputes_total", reason="no_params")
    computed = cluster.metric("vd-0", "globalkv_engine_vllm_recomputed_prompts_total")
    response = _complete(cluster, "eos", _tokens(2))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    after = cluster.metric("eos", "globalkv_gateway_vllm_recomputes_total", reason="no_params")
    assert after == counted + 1
    assert cluster.metric("vd-0", "globalkv_engine_vllm_recomputed_prompts_total") == computed + 1


def test_without_a_prefills_answer_the_decode_is_never_sent(cluster: Cluster) -> None:
    served = cluster.metric("vd-0", "globalkv_engine_requests_total")
    response = _complete(cluster, "strict", _tokens(2))
    assert response.status_code == 500, response.text
    assert "injected failure" in response.text
    assert cluster.metric("vd-0", "globalkv_engine_requests_total") == served


def test_allowed_recompute_serves_when_every_prefill_failed(cluster: Cluster) -> None:
    computed = cluster.metric("vd-0", "globalkv_engine_vllm_recomputed_prompts_total")
    response = _complete(cluster, "recompute", _tokens(2))
    assert response.status_code == 200, response.text
    reason = {"reason": "prefill_failed"}
    assert cluster.metric("recompute", "globalkv_gateway_vllm_recomputes_total", **reason) == 1
    assert cluster.metric("vd-0", "globalkv_engine_vllm_recomputed_prompts_total") == computed + 1


def test_sglangs_generate_goes_to_the_sglang_pair_of_a_mixed_gateway(cluster: Cluster) -> None:
    served = cluster.metric("sd-0", "globalkv_engine_requests_total", endpoint="/generate")
    body = {"input_ids": _tokens(1), "sampling_params": {"max_new_tokens": 2}}
    for _ in range(3):
        response = httpx.post(f"{cluster.gateways['mixed']}/generate", json=body, timeout=30)
        assert response.status_code == 200, response.text
    after = cluster.metric("sd-0", "globalkv_engine_requests_total", endpoint="/generate")
    assert after == served + 3


def test_blocks_no_decode_pulled_are_freed_and_a_late_pull_fails_at_once(
    cluster: Cluster,
) -> None:
    """Called directly, as a router would: the prefill's params, then no decode in time."""
    freed = ("globalkv_engine_transfer_messages_dropped_total", {"reason": "vllm_blocks_freed"})
    before = cluster.metric("vp-short", freed[0], **freed[1])
    body = {"model": VL, "prompt": _tokens(2), "max_tokens": 1}
    body["kv_transfer_params"] = {"do_remote_decode": True}
    headers = {"x-request-id": uuid.uuid4().hex}
    prefill = httpx.post(
        f"{cluster.engines['vp-short']}/v1/completions", json=body, headers=headers, timeout=10
    )
    assert prefill.status_code == 200, prefill.text
    params = prefill.json()["kv_transfer_params"]
    assert params["remote_request_id"].startswith(headers["x-request-id"] + "-")
    assert params["remote_block_ids"] == [0, 1]  # two pages of ids
    wait_for(lambda: cluster.metric("vp-short", freed[0], **freed[1]) == before + 1, timeout=10)
    late = {**body, "max_tokens": 4, "kv_transfer_params": params}
    decode = httpx.post(
        f"{cluster.engines['vd-0']}/v1/completions", json=late, headers=headers, timeout=10
    )
    assert decode.status_code == 500
    assert decode.json()["stage"] == "connect"
    assert "prefill handshake stage" in decode.json()["message"]
