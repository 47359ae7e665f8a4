"""PD behind Envoy: `globalkv epp` chooses the prefill and the decode, each decode's
`globalkv sidecar` binds the request to the prefill the picker named, for an SGLang pool
(bootstrap rooms) and a vLLM pool (`kv_transfer_params`) side by side, every process real.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.support.envoy import Envoy
from tests.support.net import free_port, wait_for
from tests.support.procs import Proc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
VL, SG = "vl-model", "sg-model"
PAGE = 16
FAST = ("--prefill-tokens-per-s", "500000", "--prefill-overhead-ms", "1")


@dataclass
class Pool:
    engines: dict[str, str]
    sidecars: dict[str, str]
    envoy: Envoy
    epp: str

    def post(self, url: str, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
        return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=30)


def _engine_argv(name: str, port: int) -> list[str]:
    role = "prefill" if name[1] == "p" else "decode"
    argv = ["engine", "--role", role, "--port", str(port), "--page-size", str(PAGE), *FAST]
    argv += ["--decode-tokens-per-s", "2000"]
    if name.startswith("v"):
        argv += ["--api", "vllm", "--model", VL]
        if role == "prefill":
            argv += ["--kv-events-format", "vllm", "--handshake-timeout", "10"]
    else:
        argv += ["--model", SG]
    if role == "prefill":
        argv += ["--pod-id", name, "--bootstrap-port", "0", "--kv-events-endpoint", "tcp://*:0"]
        argv += ["--kv-events-replay-endpoint", "tcp://*:0"]
    return argv


COMMON = ("--host", "127.0.0.1", "--prometheus-port", "0", "--tokenizer", "byte")
FRESH = ("--worker-startup-check-interval", "0.1", "--directory-refresh-secs", "0.1")


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    procs: list[Proc] = []

    def spawn(*argv: str, name: str) -> Proc:
        proc = Proc.globalkv(*argv, name=name)
        procs.append(proc)
        return proc

    envoy: Envoy | None = None
    try:
        indexer_port = free_port()
        indexer = f"http://127.0.0.1:{indexer_port}"
        spawn(
            "indexer",
            "--host",
            "127.0.0.1",
            "--port",
            str(indexer_port),
            "--block-size",
            str(PAGE),
            name="indexer",
        )
        engines = {}
        for name in ("sp-0", "sp-1", "sd-0", "vp-0", "vd-0"):
            port = free_port()
            spawn(*_engine_argv(name, port), name=name)
            engines[name] = f"http://127.0.0.1:{port}"
        for url in engines.values():
            procs[0].wait_http(f"{url}/health")
        bootstrap = {
            name: str(
                httpx.get(f"{engines[name]}/server_info", timeout=5).json()[
                    "disaggregation_bootstrap_port"
                ]
            )
            for name in ("sp-0", "sp-1")
        }
        prefills = [a for n in ("sp-0", "sp-1") for a in ("--prefill", engines[n], bootstrap[n])]
        prefills += ["--vllm-prefill", engines["vp-0"]]
        sidecars = {}
        for decode, flag in (("sd-0", "--decode"), ("vd-0", "--vllm-decode")):
            port = free_port()
            spawn(
                "sidecar",
                *COMMON,
                *FRESH,
                "--port",
                str(port),
                flag,
                engines[decode],
                *prefills,
                "--indexer-url",
                indexer,
                name=f"sidecar-{decode}",
            )
            sidecars[decode] = f"http://127.0.0.1:{port}"
        grpc_port, http_port = free_port(), free_port()
        spawn(
            "epp",
            *COMMON,
            *FRESH,
            "--port",
            str(http_port),
            "--grpc-host",
            "127.0.0.1",
            "--grpc-port",
            str(grpc_port),
            *prefills,
            "--decode",
            sidecars["sd-0"],
            "--vllm-decode",
            sidecars["vd-0"],
            "--indexer-url",
            indexer,
            name="epp",
        )
        epp = f"http://127.0.0.1:{http_port}"
        endpoints = [u.split("//", 1)[1] for u in sidecars.values()]
        envoy = Envoy(endpoints, [f"127.0.0.1:{grpc_port}"])
        envoy.wait_ready(pickers=1, timeout=60)

        def ready() -> bool:
            for url in (epp, *sidecars.values()):
                workers = httpx.get(f"{url}/workers", timeout=5).json()["workers"]
                if not workers or not all(w["eligible"] for w in workers):
                    return False
            return True

        wait_for(ready, timeout=60, what="the picker's and the sidecars' workers")
        yield Pool(engines, sidecars, envoy, epp)
    finally:
        if envoy is not None:
            envoy.proc.stop()
        for proc in reversed(procs):
            proc.stop()


def _generate(pool: Pool, text: str) -> dict[str, Any]:
    body = {"model": SG, "text": text, "sampling_params": {"max_new_tokens": 2}}
    answer = pool.post(pool.envoy.url, "/generate", body)
    assert answer.status_code == 200, answer.text
    found: dict[str, Any] = answer.json()
    return found


def test_sglang_pd_through_envoy_reuses_the_prefix_where_the_picker_placed_it(pool: Pool) -> None:
    prefix = f"{uuid.uuid4().hex} shared system prompt for this conversation " * 4
    assert _generate(pool, prefix + "first")["meta_info"]["cached_tokens"] == 0

    def cached() -> bool:
        return _generate(pool, prefix + "again")["meta_info"]["cached_tokens"] >= len(prefix) // 2

    wait_for(cached, timeout=20, what="the prefix cached where the picker sends it")
    for turn in range(4):
        assert (
            _generate(pool, f"{prefix}turn {turn}")["meta_info"]["cached_tokens"]
            >= len(prefix) // 2
        )


@pytest.mark.parametrize("model", [SG, VL])
def test_whole_and_streamed_answers_of_both_pools_pass_intact(pool: Pool, model: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6}
    whole = pool.post(pool.envoy.url, "/v1/chat/completions", body)
    assert whole.status_code == 200, whole.text
    assert whole.json()["usage"]["completion_tokens"] == 6
    with httpx.stream(
        "POST", f"{pool.envoy.url}/v1/chat/completions", json={**body, "stream": True}, timeout=30
    ) as stream:
        assert stream.status_code == 200
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(e[6:])["model"] == model for e in events[:-1])


def test_a_long_prompt_crosses_envoy_and_both_legs_whole(pool: Pool) -> None:
    body = {"model": VL, "prompt": "z" * 100_000, "max_tokens": 1}
    answer = pool.post(pool.envoy.url, "/v1/completions", body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] == 100_001


@pytest.mark.parametrize("header", ["x-globalkv-prefill", "x-prefiller-host-port"])
def test_the_sidecar_binds_to_the_prefill_a_header_names(pool: Pool, header: str) -> None:
    named = pool.engines["sp-1"].split("//", 1)[1]
    body = {
        "model": SG,
        "text": f"{uuid.uuid4().hex} named",
        "sampling_params": {"max_new_tokens": 2},
    }
    before = httpx.get(f"{pool.sidecars['sd-0']}/workers/{named}", timeout=5).json()
    answer = pool.post(pool.sidecars["sd-0"], "/generate", body, **{header: named})
    assert answer.status_code == 200, answer.text
    after = httpx.get(f"{pool.sidecars['sd-0']}/workers/{named}", timeout=5).json()
    assert after["prefill_tokens_per_s"] is not None or after != before


def test_the_sidecar_without_a_header_chooses_the_prefill_itself(pool: Pool) -> None:
    body = {"model": VL, "prompt": "no picker here", "max_tokens": 2}
    assert pool.post(pool.sidecars["vd-0"], "/v1/completions", body).status_code == 200


@pytest.mark.parametrize("value", ["no-port", "host:99999", "a/b:1", "::1:80"])
def test_a_malformed_prefill_header_is_the_clients_400(pool: Pool, value: str) -> None:
    body = {"model": SG, "text": "x", "sampling_params": {"max_new_tokens": 1}}
    answer = pool.post(pool.sidecars["sd-0"], "/generate", body, **{"x-prefiller-host-port": value})
    assert answer.status_code == 400
    assert "x-prefiller-host-port" in answer.json()["error"]["message"]
