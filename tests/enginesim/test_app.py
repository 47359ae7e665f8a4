"""The HTTP surface over a scripted engine: shapes, streaming, errors, cancellation."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from enginesim.app import create_app
from enginesim.engine import EngineError, Generation, Prompt
from enginesim.metrics import EngineMetrics
from enginesim.textgen import ReplyWriter
from globalkv.tokenize import ByteTokenizer
from kvplumbing.release import VERSION
from tests.bootstrap.asgi import Exchange

TOKENIZER = ByteTokenizer()
WRITER = ReplyWriter(TOKENIZER)


async def tokens(ids: list[int], stall: asyncio.Event | None = None) -> AsyncIterator[int]:
    """The ids, each after one yield to the loop; with `stall`, set it and stop after one."""
    for token in ids:
        await asyncio.sleep(0)
        yield token
        if stall is not None:
            stall.set()
            await asyncio.Event().wait()


class ScriptedEngine:
    """Answers from the prompt: `!` fails it, `~` never returns from `generate`, `^` stalls
    its tokens after the first; `waiting` is set once either hang is reached."""

    role = "prefill"

    def __init__(self) -> None:
        self.seen: list[Prompt] = []
        self.cancelled = 0
        self.restarts = 0
        self.waiting = asyncio.Event()

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def begin_shutdown(self) -> None:
        return None

    async def generate(self, prompt: Prompt) -> Generation:
        self.seen.append(prompt)
        if ord("!") in prompt.input_ids:
            raise EngineError("room", "bootstrap_room mismatch")
        if ord("~") in prompt.input_ids:
            try:
                self.waiting.set()
                await asyncio.Event().wait()
            finally:
                self.cancelled += 1
        output = WRITER.tokens(prompt.max_new_tokens)
        stall = self.waiting if ord("^") in prompt.input_ids else None
        return Generation(
            prompt_tokens=len(prompt.input_ids),
            cached_tokens=2,
            tokens=tokens(output, stall),
            finish_length=len(output),
            meta={"prefill_ms": 1.5},
        )

    def server_info(self) -> dict[str, Any]:
        return {"disaggregation_mode": "prefill", "kv_events": None}

    async def restart(self) -> None:
        self.restarts += 1

    async def flush_cache(self) -> None:
        return None

    def cached_chains(self) -> dict[int, list[list[int]]]:
        return {0: [[1, 2, 3, 4]]}


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine()


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def build_app(engine: ScriptedEngine, registry: CollectorRegistry, **options: Any) -> FastAPI:
    return create_app(
        engine,
        tokenizer=TOKENIZER,
        writer=WRITER,
        metrics=EngineMetrics(registry),
        max_new_tokens=3,
        model="sim",
        server_info=lambda: {"pod_id": "p", "dp_size": 1},
        **options,
    )


@pytest.fixture
def app(engine: ScriptedEngine, registry: CollectorRegistry) -> FastAPI:
    return build_app(engine, registry)


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as http:
        yield http


def sse_payloads(text: str) -> list[Any]:
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


async def test_generate_answers_in_sglang_shape(client: httpx.AsyncClient) -> None:
    answer = (await client.post("/generate", json={"text": "hello"})).json()
    assert answer["text"] == WRITER.text(WRITER.tokens(3))
    assert answer["output_ids"] == WRITER.tokens(3)
    meta = answer["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (6, 3, 2)
    assert meta["prefill_ms"] == 1.5


async def test_batch_generate_answers_a_list_with_indexes(client: httpx.AsyncClient) -> None:
    answer = (await client.post("/generate", json={"input_ids": [[1, 2], [3]]})).json()
    assert [a["index"] for a in answer] == [0, 1]
    assert [a["meta_info"]["prompt_tokens"] for a in answer] == [2, 1]


async def test_streamed_generate_text_is_cumulative(client: httpx.AsyncClient) -> None:
    response = await client.post("/generate", json={"text": "hello", "stream": True})
    chunks = sse_payloads(response.text)
    assert [c["text"] for c in chunks][-1] == WRITER.text(WRITER.tokens(3))
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


async def test_completion_usage_counts_cached_tokens_once_per_prompt(
    client: httpx.AsyncClient,
) -> None:
    body = {"prompt": ["ab", "cd"], "n": 2, "max_tokens": 2}
    answer = (await client.post("/v1/completions", json=body)).json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    assert answer["usage"] == {
        "prompt_tokens": 6,
        "completion_tokens": 8,
        "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


async def test_streamed_chat_sends_deltas_then_usage(client: httpx.AsyncClient) -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 4,
    }
    chunks = sse_payloads((await client.post("/v1/chat/completions", json=body)).text)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d["content"] for d in deltas) == WRITER.text(WRITER.tokens(4))
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}


async def test_engine_error_answers_its_status_and_stage(
    client: httpx.AsyncClient, registry: CollectorRegistry
) -> None:
    answer = await client.post("/generate", json={"text": "bad!"})
    assert answer.status_code == 500
    assert answer.json()["error"]["stage"] == "room"
    assert answer.json()["error"]["message"] == "bootstrap_room mismatch"
    openai = await client.post("/v1/completions", json={"prompt": "bad!"})
    assert openai.json()["object"] == "error"
    assert openai.json()["stage"] == "room"
    failures = registry.get_sample_value(
        "globalkv_engine_request_failures_total", {"stage": "room"}
    )
    assert failures == 2


async def test_first_failure_cancels_the_other_prompts_of_the_request(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    answer = await client.post("/generate", json={"text": ["wait~", "bad!"]})
    assert answer.status_code == 500
    assert engine.cancelled == 1


async def test_malformed_bodies_answer_422_naming_the_field(client: httpx.AsyncClient) -> None:
    answer = await client.post("/generate", json={"text": "a", "bootstrap_room": "x"})
    assert answer.status_code == 422
    assert "bootstrap_room" in answer.json()["error"]["message"]
    answer = await client.post("/v1/chat/completions", json={"messages": []})
    assert answer.status_code == 422
    assert "messages" in answer.json()["message"]
    answer = await client.post("/v1/chat/completions", json={"messages": [{"content": "x"}]})
    assert answer.status_code == 400
    assert "role" in answer.json()["message"]


async def test_info_endpoints_and_restart(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    assert (await client.get("/health")).status_code == 200
    info = (await client.get("/server_info")).json()
    assert info == {
        "pod_id": "p",
        "dp_size": 1,
        "disaggregation_mode": "prefill",
        "kv_events": None,
        "version": VERSION,
    }
    assert (await client.get("/get_server_info")).json() == info
    assert (await client.get("/v1/models")).json()["data"][0]["id"] == "sim"
    assert (await client.get("/get_model_info")).json()["model_path"] == "sim"
    assert (await client.post("/_sim/restart")).json()["restarted"] is True
    assert engine.restarts == 1
    cache = (await client.get("/_sim/cache")).json()
    assert cache == {"ranks": [{"dp_rank": 0, "prefixes": [[1, 2, 3, 4]]}]}
    metrics = (await client.get("/metrics")).text
    assert "globalkv_engine_requests_total" in metrics


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"text": "wait~"}),
        ("/v1/completions", {"prompt": "wait~", "n": 2}),
        ("/generate", {"text": "first token, then stall^"}),
    ],
)
async def test_a_client_leaving_cancels_its_prompts_at_once(
    app: FastAPI,
    engine: ScriptedEngine,
    registry: CollectorRegistry,
    path: str,
    body: dict[str, Any],
) -> None:
    exchange = Exchange("POST", path, [json.dumps(body).encode()])
    served = asyncio.create_task(exchange.run(app))
    await engine.waiting.wait()
    exchange.leave()
    await asyncio.wait_for(served, timeout=10)
    assert exchange.status == 499
    assert engine.cancelled == (body.get("n", 1) if "~" in json.dumps(body) else 0)
    sample = registry.get_sample_value
    assert sample("globalkv_engine_requests_total", {"endpoint": path, "outcome": "cancelled"}) == 1
    assert sample("globalkv_engine_running_requests") == 0


async def test_a_client_leaving_mid_stream_is_counted_and_frees_its_prompts(
    app: FastAPI, engine: ScriptedEngine, registry: CollectorRegistry
) -> None:
    exchange = Exchange("POST", "/generate", [b'{"text": "stall^", "stream": true}'])
    served = asyncio.create_task(exchange.run(app))
    await engine.waiting.wait()
    exchange.leave()
    await asyncio.wait_for(served, timeout=10)
    assert exchange.status == 200
    assert exchange.body.startswith(b"data: ")
    labels = {"endpoint": "/generate", "outcome": "cancelled"}
    assert registry.get_sample_value("globalkv_engine_requests_total", labels) == 1
    assert registry.get_sample_value("globalkv_engine_running_requests") == 0


async def test_a_body_over_the_limit_gets_413_unparsed_announced_or_not(
    engine: ScriptedEngine, registry: CollectorRegistry
) -> None:
    async def chunked() -> AsyncIterator[bytes]:
        for part in (b'{"prompt": "', b"x" * 100, b'"}'):
            yield part

    app = build_app(engine, registry, max_body_bytes=64)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://e") as http:
        announced = await http.post("/generate", json={"text": "x" * 100})
        streamed = await http.post("/v1/completions", content=chunked())
        elsewhere = await http.post("/nowhere", content=b"x" * 100)
        fits = await http.post("/generate", json={"text": "hi"})
    assert "content-length" not in streamed.request.headers
    assert (announced.status_code, streamed.status_code, elsewhere.status_code) == (413, 413, 413)
    assert announced.json()["error"]["message"] == "request body larger than 64 bytes"
    assert streamed.json()["stage"] == "request"
    assert fits.status_code == 200
    assert len(engine.seen) == 1
    labels = {"endpoint": "other", "outcome": "error"}
    assert registry.get_sample_value("globalkv_engine_requests_total", labels) == 1


@pytest.mark.parametrize("api", ["sglang", "vllm"])
async def test_models_lists_each_adapter_with_the_model_as_parent(
    engine: ScriptedEngine, registry: CollectorRegistry, api: str
) -> None:
    app = build_app(engine, registry, api=api, adapters=("ad-a", "ad-b"))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://engine"
    ) as http:
        data = (await http.get("/v1/models")).json()["data"]
    assert [(m["id"], m["parent"], m["owned_by"]) for m in data] == [
        ("sim", None, api),
        ("ad-a", "sim", api),
        ("ad-b", "sim", api),
    ]


@pytest.mark.parametrize(
    ("api", "path", "body", "namespace"),
    [
        ("vllm", "/v1/completions", {"model": "ad-a", "prompt": "hi"}, ("ad-a", 1, None)),
        (
            "vllm",
            "/v1/completions",
            {"model": "sim", "prompt": "hi", "cache_salt": "t"},
            (None, None, "t"),
        ),
        ("vllm", "/v1/completions", {"model": "sim:ad-a", "prompt": "hi"}, (None, None, None)),
        ("sglang", "/v1/completions", {"model": "sim:ad-b", "prompt": "hi"}, ("ad-b", 2, None)),
        (
            "sglang",
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "lora_path": "ad-a",
                "cache_salt": "t",
            },
            ("ad-a", 1, "t"),
        ),
        (
            "sglang",
            "/generate",
            {"text": ["a", "b"], "lora_path": ["ad-a", "ad-a"]},
            ("ad-a", 1, None),
        ),
        ("sglang", "/generate", {"text": "a", "cache_salt": ""}, (None, None, None)),
        ("sglang", "/v1/completions", {"model": "ad-a", "prompt": "hi"}, (None, None, None)),
    ],
)
async def test_each_api_reads_adapter_and_salt_as_its_engine_does(
    engine: ScriptedEngine,
    registry: CollectorRegistry,
    api: str,
    path: str,
    body: dict[str, Any],
    namespace: tuple[str | None, int | None, str | None],
) -> None:
    """vLLM: the adapter is the `model`; SGLang: `base:adapter` or `lora_path` (a bare
    adapter name as the model serves the base model there)."""
    app = build_app(engine, registry, api=api, adapters=("ad-a", "ad-b"))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://engine"
    ) as http:
        assert (await http.post(path, json=body)).status_code == 200
    seen = engine.seen[-1].namespace
    assert (seen.lora_name, seen.lora_id, seen.cache_salt) == namespace


@pytest.mark.parametrize(
    ("api", "body"),
    [
        ("vllm", {"prompt": "hi", "cache_salt": ""}),
        ("vllm", {"prompt": "hi", "cache_salt": "a/b"}),
        ("vllm", {"prompt": "hi", "cache_salt": "s" * 129}),
        ("sglang", {"prompt": "hi", "lora_path": "unknown"}),
        ("sglang", {"prompt": "hi", "model": "sim:unknown"}),
        ("sglang", {"prompt": ["a", "b"], "cache_salt": ["s", "t"]}),
    ],
)
async def test_a_salt_or_adapter_the_engine_refuses_is_a_400(
    engine: ScriptedEngine, registry: CollectorRegistry, api: str, body: dict[str, Any]
) -> None:
    app = build_app(engine, registry, api=api, adapters=("ad-a",))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://engine"
    ) as http:
        assert (await http.post("/v1/completions", json=body)).status_code == 400
    assert engine.seen == []
