"""`bench.gateway --engine vllm`: the same measurement on vLLM prefill/decode pairs.

The mocks are vLLM workers (`bench.gateway_mocks` with `vllm-prefill:`/`vllm-decode:`
ports: the prefill answers `kv_transfer_params`, the decode the completion), the load is
`POST /v1/completions`, and each router runs in its vLLM PD mode: globalkv with
`--vllm-prefill`/`--vllm-decode`, smg with `--pd-disaggregation --backend vllm`. Every
request is two calls in sequence (prefill, then decode), so the latency a router adds
includes one more worker round trip than the direct call to the decode mock.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

HOST = "127.0.0.1"
PATH = "/v1/completions"
PROMPT = " ".join(f"word{i}" for i in range(64))
"""Text: smg's completions schema takes no token-id prompt."""


def body(stream: bool, max_tokens: int = 4) -> bytes:
    return json.dumps(
        {"model": "mock", "prompt": PROMPT, "max_tokens": max_tokens, "stream": stream}
    ).encode()


def mock_ports(prefills: Sequence[int], decodes: Sequence[int]) -> list[str]:
    return [*(f"vllm-prefill:{p}" for p in prefills), *(f"vllm-decode:{d}" for d in decodes)]


def globalkv_argv(
    command: Sequence[str], prefills: Sequence[int], decodes: Sequence[int], port: int
) -> list[str]:
    argv = [*command, "--host", HOST, "--port", str(port)]
    for p in prefills:
        argv += ["--vllm-prefill", f"http://{HOST}:{p}"]
    for d in decodes:
        argv += ["--vllm-decode", f"http://{HOST}:{d}"]
    return [*argv, "--policy", "round_robin"]


def smg_argv(
    command: Sequence[str], prefills: Sequence[int], decodes: Sequence[int], port: int
) -> list[str]:
    argv = [*command, "--pd-disaggregation", "--backend", "vllm"]
    argv += ["--host", HOST, "--port", str(port)]
    for p in prefills:
        argv += ["--prefill", f"http://{HOST}:{p}"]
    for d in decodes:
        argv += ["--decode", f"http://{HOST}:{d}"]
    return [*argv, "--policy", "round_robin"]
