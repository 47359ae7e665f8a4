"""`globalkv up --entry envoy`: the plan it makes, and the cluster it starts serving through
Envoy, a picker and a sidecar before each decode."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from globalkv.stack.cluster import LocalCluster
from globalkv.stack.config import StackConfig
from globalkv.stack.plan import check_plan, plan_stack, ports_needed


def _config(**fields: object) -> StackConfig:
    return StackConfig.model_validate({"entry": "envoy", "gateway_port": 0, **fields})


def test_the_plan_puts_a_sidecar_before_each_decode_and_envoy_before_the_pickers(
    tmp_path: Path,
) -> None:
    config = _config(prefill=2, decode=3, gateways=2, engine="vllm")
    needed = ports_needed(config)
    plan = plan_stack(config, iter(range(20000, 20000 + needed)), tmp_path)
    check_plan(plan)
    roles = [c.role for c in plan.components]
    assert roles.count("sidecar") == 3
    assert roles.count("epp") == 2
    (envoy,) = plan.gateways
    assert envoy.argv[2] == "envoy"
    assert "--response-headers" in envoy.argv, "PD: the prefill's load settled at the first byte"
    sidecars, pickers = plan.by_role("sidecar"), plan.by_role("epp")
    endpoints = [envoy.argv[i + 1] for i, a in enumerate(envoy.argv) if a == "--endpoint"]
    assert endpoints == [s.url.split("//", 1)[1] for s in sidecars]
    assert envoy.argv.count("--picker") == 2
    for sidecar, decode in zip(sidecars, plan.by_role("decode"), strict=True):
        assert sidecar.argv.count("--vllm-decode") == 1
        assert decode.url in sidecar.argv
        assert sidecar.argv.count("--vllm-prefill") == 2
    for picker in pickers:
        assert [picker.argv[i + 1] for i, a in enumerate(picker.argv) if a == "--vllm-decode"] == [
            s.url for s in sidecars
        ]
    ports = [int(c.url.rsplit(":", 1)[1]) for c in plan.components]
    assert len(set(ports)) == len(ports)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_up_with_the_envoy_entry_serves_through_envoy_and_reuses_the_cache(
    tmp_path: Path,
) -> None:
    """Served through Envoy with the cache reused; and the picker settles a pick's prefill
    part when the answer's first byte passes Envoy, while the decode streams on."""
    slow = ["--decode-tokens-per-s", "20"]
    with LocalCluster(_config(run_dir=tmp_path, start_timeout=60, decode_args=slow)) as cluster:
        body = {"model": "emulated-model", "prompt": "a prompt long enough for blocks " * 8}
        first = httpx.post(f"{cluster.gateway_url}/v1/completions", json=body, timeout=30)
        assert first.status_code == 200, first.text
        cached = 0
        for _ in range(20):  # until the prefill's KV events reached the index
            again = httpx.post(f"{cluster.gateway_url}/v1/completions", json=body, timeout=30)
            cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            if cached:
                break
        assert cached >= 240
        assert (tmp_path / "envoy" / "envoy.json").is_file()
        (picker,) = [c for c in cluster.components if c.role == "epp"]
        fresh = {**body, "prompt": "another prompt, none of it cached " * 8}
        streamed = {**fresh, "max_tokens": 60, "stream": True}
        url = f"{cluster.gateway_url}/v1/completions"
        with httpx.stream("POST", url, json=streamed, timeout=30) as answer:
            assert answer.status_code == 200
            pieces = answer.iter_bytes()
            next(pieces)  # the first byte; 60 tokens at 20 per second follow
            workers = httpx.get(f"{picker.url}/workers", timeout=5).json()["workers"]
            loads = {
                role: [
                    (w["in_flight"], w["queued_prefill_tokens"])
                    for w in workers
                    if w["role"] == role
                ]
                for role in ("prefill", "decode")
            }
            assert sorted(loads["prefill"]) == [(0, 0), (1, 0)], loads
            assert sorted(loads["decode"]) == [(0, 0), (1, 0)], loads
            rest = b"".join(pieces)
        assert b"[DONE]" in rest
