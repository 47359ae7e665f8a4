"""One error shape per API family, on every refusal path: OpenAI's error object on the
OpenAI endpoints whoever refused, on `/generate` the gateway's own refusals in the same
`{"error": {...}}` and a worker's error as the worker wrote it (SGLang's shape)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from gateway.http.server import HttpServer
from globalkv.tokenize import load_tokenizer
from tests.gateway.fakes import DECODES, Cluster, config, make_gateway
from tests.gateway.test_server import post, read_answer, serving

OPENAI = ("/v1/completions", "/v1/chat/completions")
LIMIT = 300


def _valid(path: str) -> dict[str, Any]:
    if path == "/generate":
        return {"text": "hello"}
    if path == "/v1/completions":
        return {"model": "m", "prompt": "hello"}
    return {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


def _with_surrogate(path: str) -> bytes:
    return json.dumps(_valid(path)).replace("hello", "hello\\ud800").encode()


async def _exchange(server: HttpServer, request: bytes) -> tuple[int, Any]:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(request)
        status, _, body = await read_answer(reader)
    finally:
        writer.close()
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body.decode()


def _raw(path: str, body: bytes) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nhost: gw\r\ncontent-length: {len(body)}\r\n\r\n"
    return head.encode() + body


def _openai_shaped(body: Any) -> dict[str, Any]:
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert {"message", "type", "param", "code"} <= set(error), error
    assert isinstance(error["message"], str)
    assert error["message"]
    return error


@pytest.mark.parametrize("path", ["/generate", *OPENAI])
async def test_the_gateways_own_refusals_have_one_shape(path: str) -> None:
    cluster = Cluster()
    gateway = await make_gateway(
        cluster, config(max_payload_size=LIMIT), tokenizer=load_tokenizer("byte")
    )
    refusals = {
        "bad JSON": _raw(path, b"{"),
        "bad field": post(path, {**_valid(path), "stream": "yes"}),
        "too large": post(path, {**_valid(path), "pad": "x" * LIMIT}),
        "surrogate": _raw(path, _with_surrogate(path)),
    }
    async with serving(gateway) as server:
        answers = {name: await _exchange(server, request) for name, request in refusals.items()}
        for worker in gateway.pool:
            for _ in range(10):
                worker.breaker.record(False, "down")
        answers["no workers"] = await _exchange(server, post(path, _valid(path)))
    statuses = {name: status for name, (status, _) in answers.items()}
    assert statuses == {
        "bad JSON": 400,
        "bad field": 400,
        "too large": 413,
        "surrogate": 400,
        "no workers": 503,
    }
    errors = {name: _openai_shaped(body) for name, (_, body) in answers.items()}
    assert "lone surrogate" in errors["surrogate"]["message"]
    assert errors["no workers"]["type"] == "no_available_workers"
    assert not cluster.inference(), "nothing refused reached a worker"


FLAT = {
    "object": "error",
    "message": "The model `other` does not exist.",
    "type": "NotFoundError",
    "param": "model",
    "code": 404,
}


@pytest.mark.parametrize(
    ("status", "answer"),
    [
        (404, FLAT),
        (422, {**FLAT, "message": "invalid request body: max_tokens", "code": 422}),
        (422, {"detail": [{"loc": ["body", "max_tokens"], "msg": "not an int"}]}),
        (500, "Internal Server Error"),
    ],
)
async def test_a_workers_error_on_an_openai_endpoint_is_openais_error_object(
    status: int, answer: Any
) -> None:
    cluster = Cluster()

    async def refuse(_: httpx.Request, body: Any) -> httpx.Response:
        if isinstance(answer, str):
            return httpx.Response(status, text=answer)
        return httpx.Response(status, json=answer)

    for url in DECODES:
        cluster.on(url, refuse)
    gateway = await make_gateway(cluster, config(retry={"disabled": True}))
    async with serving(gateway) as server:
        for path in OPENAI:
            got_status, body = await _exchange(server, post(path, {**_valid(path), "n": 1}))
            assert got_status == status
            error = _openai_shaped(body)
            if isinstance(answer, dict) and answer.get("object") == "error":
                assert error == {k: v for k, v in answer.items() if k != "object"}
            elif isinstance(answer, dict):
                assert "max_tokens" in error["message"]
            else:
                assert error["message"] == answer
        got_status, body = await _exchange(server, post("/generate", _valid("/generate")))
    assert (got_status, body) == (status, answer), "/generate passes SGLang's shape on"
