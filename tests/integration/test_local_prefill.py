"""Disaggregating only when it pays, end to end: a vLLM prefill and a vLLM decode that
publishes its cache's KV events, the indexer, and a gateway with `--pd-decider
local-when-faster`, each a real process on its own ports.

The decider needs a measured prefill rate, so the first request is disaggregated
(`unmeasured`); once the decode holds a prompt's prefix (it keeps what it pulled) the same
prompt costs it nothing to prefill, no transfer, and goes to it alone.
"""

from __future__ import annotations

import random
import subprocess
import sys
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

MODEL = "vl-model"
PAGE = 16
DECISIONS = "globalkv_gateway_pd_decisions_total"
RECOMPUTED = "globalkv_engine_vllm_recomputed_prompts_total"


@dataclass
class Stack:
    prefill: str
    decode: str
    indexer: str
    gateway: str

    def decisions(self, decision: str, reason: str) -> float:
        return scrape(self.gateway, DECISIONS, decision=decision, reason=reason)

    def decode_holds(self, tokens: list[int]) -> bool:
        answer = httpx.post(
            f"{self.indexer}/v1/lookup", json={"model": MODEL, "token_ids": tokens}, timeout=5
        ).json()
        return any(p["pod"] == "vd-0" and p["hit_tokens"] == len(tokens) for p in answer["pods"])


def _engine(role: str, name: str, port: int) -> list[str]:
    argv = ["engine", "--role", role, "--port", str(port), "--page-size", str(PAGE)]
    argv += ["--api", "vllm", "--model", MODEL, "--pod-id", name, "--kv-events-format", "vllm"]
    argv += ["--prefill-tokens-per-s", "20000", "--decode-tokens-per-s", "2000"]
    argv += ["--kv-events-endpoint", "tcp://*:0"]
    argv += ["--kv-events-replay-endpoint", "tcp://*:0"]
    if role == "prefill":
        argv += ["--bootstrap-port", "0", "--handshake-timeout", "10"]
    else:
        argv.append("--decode-kv-events")
    return argv


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    procs: list[Proc] = []
    try:
        ports = {name: free_port() for name in ("indexer", "vp-0", "vd-0", "gateway")}
        url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        indexer = Proc.globalkv(
            *("indexer", "--host", "127.0.0.1", "--port", str(ports["indexer"])),
            *("--block-size", str(PAGE)),
            name="indexer",
        )
        procs.append(indexer)
        for role, name in (("prefill", "vp-0"), ("decode", "vd-0")):
            procs.append(Proc.globalkv(*_engine(role, name, ports[name]), name=name))
        for proc, name in zip(procs, ("indexer", "vp-0", "vd-0"), strict=True):
            proc.wait_http(f"{url[name]}/health")
        argv = ["gateway", "--host", "127.0.0.1", "--port", str(ports["gateway"])]
        argv += ["--prometheus-port", "0", "--indexer-url", url["indexer"]]
        argv += ["--vllm-prefill", url["vp-0"], "--vllm-decode", url["vd-0"]]
        argv += ["--tokenizer", "byte", "--model", MODEL, "--pd-decider", "local-when-faster"]
        argv += ["--worker-startup-check-interval", "0.1"]
        gateway = Proc.globalkv(*argv, name="gateway")
        procs.append(gateway)
        gateway.wait_http(f"{url['gateway']}/liveness")
        built = Stack(url["vp-0"], url["vd-0"], url["indexer"], url["gateway"])
        wait_for(lambda: _subscribed(built) == {"vp-0", "vd-0"}, timeout=40, what="both pods")
        yield built
    finally:
        for proc in reversed(procs):
            proc.stop()


def _subscribed(stack: Stack) -> set[str]:
    pods = httpx.get(f"{stack.indexer}/v1/pods", timeout=5).json()["pods"]
    return {p["id"] for p in pods if p["state"] and p["state"]["subscribed"]}


def _tokens(pages: int) -> list[int]:
    rng = random.Random(uuid.uuid4().int)
    return [rng.randrange(1, 250) for _ in range(pages * PAGE)]


def _complete(stack: Stack, prompt: list[int], **fields: Any) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, **fields}
    return httpx.post(f"{stack.gateway}/v1/completions", json=body, timeout=30)


def test_the_decode_is_indexed_as_a_decode(stack: Stack) -> None:
    pods = {p["id"]: p for p in httpx.get(f"{stack.indexer}/v1/pods", timeout=5).json()["pods"]}
    assert pods["vd-0"]["role"] == "decode"
    assert pods["vp-0"]["role"] == "prefill"


def test_a_prompt_the_decode_holds_is_prefilled_there_alone(stack: Stack) -> None:
    prompt = _tokens(8)
    first = _complete(stack, prompt)
    assert first.status_code == 200, first.text
    # The decode kept what it pulled, and said so in its KV events.
    wait_for(lambda: stack.decode_holds(prompt), timeout=10, what="the decode's events")
    local = stack.decisions("local", "faster")
    recomputed = scrape(stack.decode, RECOMPUTED)
    again = _complete(stack, prompt)
    assert again.status_code == 200, again.text
    assert stack.decisions("local", "faster") == local + 1
    assert scrape(stack.decode, RECOMPUTED) == recomputed + 1
    usage = again.json()["usage"]
    # its own cache's prefix, all but the page holding the last token (always computed)
    assert usage["prompt_tokens_details"]["cached_tokens"] == len(prompt) - PAGE
    assert len(again.json()["choices"][0]["text"]) > 0


def test_a_local_prefill_streams_its_answer(stack: Stack) -> None:
    prompt = _tokens(4)
    assert _complete(stack, prompt).status_code == 200
    wait_for(lambda: stack.decode_holds(prompt), timeout=10, what="the decode's events")
    local = stack.decisions("local", "faster")
    with httpx.stream(
        "POST",
        f"{stack.gateway}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 6, "stream": True},
        timeout=30,
    ) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]"
    assert len(events) >= 3
    assert stack.decisions("local", "faster") == local + 1


def test_every_choice_is_counted_with_its_reason(stack: Stack) -> None:
    counted = {
        (labels["decision"], labels["reason"])
        for labels, value in _samples(stack.gateway)
        if value > 0
    }
    # the very first request had no measured prefill rate to estimate from
    assert ("disaggregate", "unmeasured") in counted
    assert ("local", "faster") in counted


def _samples(url: str) -> list[tuple[dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=5).text
    return [
        (sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == DECISIONS
    ]


def test_doctor_shows_the_decider_and_what_it_did_with_the_probe(stack: Stack) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "globalkv",
            "doctor",
            "--gateway",
            stack.gateway,
            "--indexer",
            stack.indexer,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    report = done.stdout
    assert "gateway PD decider" in report, report
    assert "local-when-faster: a vLLM decode prefills" in report
    assert "probe PD decision" in report
