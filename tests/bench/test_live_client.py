"""The live replay's client over `httpx.MockTransport`: what it sends, reads and refuses."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx

from bench.replay.config import ReplaySettings
from bench.replay.live import replay_through
from bench.replay.tokens import expand
from bench.replay.trace import read_trace
from tests.bench.traces import row, write_trace


def _sse(*payloads: object) -> bytes:
    return b"".join(b"data: " + json.dumps(p).encode() + b"\n\n" for p in payloads) + (
        b"data: [DONE]\n\n"
    )


def _handler(seen: list[dict[str, object]]) -> httpx.MockTransport:
    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        length = len(body["input_ids"])
        if length == 5:
            return httpx.Response(503, text="no prefill available")
        if length == 6:
            return httpx.Response(200, content=b"data: {not json\n\n")
        if length == 7:
            return httpx.Response(
                200, content=_sse({"text": "a", "meta_info": {"cached_tokens": "x"}})
            )
        meta = {"cached_tokens": 4, "queue_ms": 20.0, "prefill_ms": 30.0}
        first = {"text": "a", "meta_info": {**meta, "completion_tokens": 1}}
        return httpx.Response(200, content=_sse(first, {"text": "ab", "meta_info": meta}))

    return httpx.MockTransport(answer)


async def test_answers_are_read_and_bad_ones_counted_as_failures(tmp_path: Path) -> None:
    rows = [
        row(0, 8, [1, 2], output=3),
        row(1, 5, [1, 9]),  # answered 503
        row(2, 6, [1, 8]),  # a chunk that is not JSON
        row(3, 7, [1, 7]),  # meta_info with a non-numeric cached_tokens
        row(4, 8, [1, 3], output=40),
    ]
    path = write_trace(tmp_path / "t.jsonl", rows)
    settings = ReplaySettings(trace=str(path), time_scale=0.001, max_output_tokens=16)
    trace = read_trace(path, block_size=4)
    seen: list[dict[str, object]] = []
    async with httpx.AsyncClient(transport=_handler(seen)) as client:
        record = await replay_through("http://gateway", settings, trace, "prefix", client=client)
    assert record.failed == 3
    assert record.cached[0] == record.cached[4] == 4
    assert record.queue[0] == 0.02
    assert record.prefill[4] == 0.03
    assert [math.isnan(t) for t in record.ttft] == [False, True, True, True, False]
    first = next(body for body in seen if body["input_ids"] == expand([1, 2], 8, 4))
    assert first["stream"] is True
    assert first["sampling_params"] == {"max_new_tokens": 3}
    capped = next(body for body in seen if body["input_ids"] == expand([1, 3], 8, 4))
    assert capped["sampling_params"] == {"max_new_tokens": 16}


async def test_a_vllm_stack_is_asked_on_completions_and_read_from_usage(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [row(0, 8, [1, 2], output=3), row(1, 8, [1, 3])])
    settings = ReplaySettings(trace=str(path), time_scale=0.001, engine="vllm")
    trace = read_trace(path, block_size=4)
    seen: list[tuple[str, dict[str, object]]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.path, body))
        usage = {"prompt_tokens": 8, "prompt_tokens_details": {"cached_tokens": 4}}
        if body["prompt"] == expand([1, 3], 8, 4):
            usage = {"prompt_tokens": 8}  # no cached count: not a vLLM answer
        return httpx.Response(
            200, content=_sse({"choices": [{"text": "a"}]}, {"choices": [], "usage": usage})
        )

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        record = await replay_through("http://gateway", settings, trace, "prefix", client=client)
    assert record.failed == 1
    assert record.cached[0] == 4
    assert record.queue[0] == record.prefill[0] == 0
    path_sent, body = next(s for s in seen if s[1]["prompt"] == expand([1, 2], 8, 4))
    assert path_sent == "/v1/completions"
    assert body["max_tokens"] == 3
    assert body["stream_options"] == {"include_usage": True}


async def test_several_gateways_take_the_requests_in_turn(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [row(i, 8, [1, 2 + i]) for i in range(4)])
    settings = ReplaySettings(trace=str(path), time_scale=0.001, gateways=2)
    trace = read_trace(path, block_size=4)
    hosts: dict[int, str] = {}

    def answer(request: httpx.Request) -> httpx.Response:
        ids = json.loads(request.content)["input_ids"]
        hosts[ids[-1]] = request.url.host
        meta = {"cached_tokens": 0}
        return httpx.Response(200, content=_sse({"text": "a", "meta_info": meta}))

    urls = ["http://gw-0", "http://gw-1"]
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        record = await replay_through(urls, settings, trace, "prefix", client=client)
    assert record.failed == 0
    last_ids = [expand([1, 2 + i], 8, 4)[-1] for i in range(4)]
    assert [hosts[i] for i in last_ids] == ["gw-0", "gw-1", "gw-0", "gw-1"]
