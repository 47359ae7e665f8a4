"""The HTTP surface: endpoints, auth, limits, 4xx for bad input, admin API, metrics."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from gateway.http.answer import Answer
from gateway.http.server import HttpServer, default_max_connections
from gateway.requests.bodies import MAX_BATCH
from gateway.serving.app import create_app
from gateway.serving.inference import Inference
from gateway.serving.reading import TOKENIZE_INLINE_MAX
from gateway.serving.service import Gateway
from gateway.settings.workers import WorkerSpec
from globalkv.tokenize import ByteTokenizer
from tests.gateway.fakes import (
    DECODES,
    PREFILLS,
    Cluster,
    StubLookup,
    config,
    make_gateway,
    sample,
)
from tests.support.clock import FakeClock


@pytest.fixture(params=["asgi", "server"])
def front(request: pytest.FixtureRequest) -> str:
    """Every test through the ASGI app and through the gateway's own server."""
    return str(request.param)


SERVER_ONLY = pytest.mark.parametrize("front", ["server"])
"""Inference is answered by the gateway's own server; the ASGI app has no inference routes."""


@asynccontextmanager
async def client_for(gateway: Gateway, front: str) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(gateway, run_monitor=False)
    if front == "asgi":
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            yield client
        return
    server = HttpServer(Inference(gateway), app)
    await server.start("127.0.0.1", 0)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as client:
            yield client
    finally:
        await server.shutdown()


@pytest.fixture
async def setup() -> tuple[Cluster, Gateway]:
    cluster = Cluster()
    lookup = StubLookup()
    gateway = await make_gateway(
        cluster,
        config(api_key="k", admin_token="admin", max_payload_size=2000),
        lookup=lookup,
        tokenizer=ByteTokenizer(),
    )
    return cluster, gateway


AUTH = {"authorization": "Bearer k"}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"text": "hello"}),
        ("/v1/completions", {"prompt": [1, 2, 3], "model": "m"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}),
    ],
)
@SERVER_ONLY
async def test_inference_endpoints_route_and_answer(
    setup: tuple[Cluster, Gateway], path: str, body: dict[str, Any], front: str
) -> None:
    cluster, gateway = setup
    async with client_for(gateway, front) as client:
        response = await client.post(path, json=body, headers=AUTH)
    assert response.status_code == 200
    assert cluster.inference("decode")[0].path == path
    name = {"/generate": "generate", "/v1/completions": "completions"}.get(path, "chat")
    assert sample(gateway, "globalkv_gateway_requests_total", endpoint=name, status="200") == 1


@SERVER_ONLY
async def test_text_is_tokenized_and_looked_up(setup: tuple[Cluster, Gateway], front: str) -> None:
    _, gateway = setup
    lookup = gateway.router._lookup
    assert isinstance(lookup, StubLookup)
    async with client_for(gateway, front) as client:
        await client.post("/generate", json={"text": "hi"}, headers=AUTH)
        await client.post("/generate", json={"input_ids": [[5, 6], [7]]}, headers=AUTH)
    assert lookup.asked == [("m", ByteTokenizer().encode("hi")), ("m", [5, 6])]


@SERVER_ONLY
async def test_without_tokenizer_or_index_it_routes_by_load_and_counts_it(front: str) -> None:
    cluster = Cluster()
    gateway = await make_gateway(cluster, config(), lookup=StubLookup(down=True))
    async with client_for(gateway, front) as client:
        assert (await client.post("/generate", json={"text": "x"})).status_code == 200
        assert (await client.post("/generate", json={"input_ids": [1]})).status_code == 200
    assert sample(gateway, "globalkv_gateway_routing_fallbacks_total", reason="no_tokenizer") == 1
    assert (
        sample(gateway, "globalkv_gateway_routing_fallbacks_total", reason="index_unavailable") == 1
    )
    assert (
        sample(
            gateway,
            "globalkv_gateway_routing_decisions_total",
            role="prefill",
            policy="prefix",
            outcome="fallback",
        )
        == 2
    )


@pytest.mark.parametrize(
    ("path", "content", "status", "message"),
    [
        ("/generate", b"{not json", 400, "not valid JSON"),
        ("/generate", b"[1]", 400, "JSON object"),
        ("/generate", b'{"text": "a", "input_ids": [1]}', 400, "exactly one"),
        ("/generate", b'{"input_ids": [1, -2]}', 400, "token ids"),
        ("/generate", b'{"input_ids": [1, true]}', 400, "token ids"),
        ("/generate", b'{"input_ids": [[2], [false, 3]]}', 400, "token ids"),
        ("/generate", b'{"input_ids": [1, 2.0]}', 400, "token ids"),
        ("/generate", b'{"input_ids": []}', 400, "non-empty"),
        ("/generate", b'{"text": 3}', 400, "'text'"),
        ("/generate", b'{"text": "x", "stream": "yes"}', 400, "'stream'"),
        ("/v1/completions", b'{"prompt": 5}', 400, "'prompt'"),
        ("/v1/completions", b'{"prompt": [1, "a"]}', 400, "token ids"),
        ("/v1/completions", b'{"prompt": [4294967295, false]}', 400, "token ids"),
        ("/v1/chat/completions", b'{"messages": []}', 400, "'messages'"),
        ("/v1/chat/completions", b'{"messages": [{"role": "u"}], "n": 0}', 400, "'n'"),
        ("/v1/chat/completions", b'{"messages": [{"content": "x"}]}', 400, "'role'"),
        ("/v1/chat/completions", b'{"messages": [{"role": "u"}], "n": 4097}', 400, "at most 4096"),
        ("/generate", b'{"text": "' + b"x" * 3000 + b'"}', 413, "max-payload-size"),
    ],
)
@SERVER_ONLY
async def test_bad_input_gets_a_clear_4xx(
    setup: tuple[Cluster, Gateway], path: str, content: bytes, status: int, message: str, front: str
) -> None:
    cluster, gateway = setup
    async with client_for(gateway, front) as client:
        response = await client.post(path, content=content, headers=AUTH)
    assert response.status_code == status
    assert message in response.json()["error"]["message"]
    assert cluster.inference() == []


async def test_a_body_too_deep_to_write_gets_400_whichever_parser_read_it() -> None:
    cluster = Cluster()
    gateway = await make_gateway(cluster, config())
    inference = Inference(gateway)
    for depth in (1000, 3000, 200_000):
        raw = b'{"input_ids": [1], "a": ' + b"[" * depth + b"]" * depth + b"}"
        answer = await inference.handle("/generate", None, raw)
        assert isinstance(answer, Answer)
        assert (answer.status, b"nested too deeply" in answer.body) == (400, True)
    assert cluster.inference() == []


async def test_a_batch_of_more_than_max_batch_elements_gets_400() -> None:
    cluster = Cluster()
    inference = Inference(await make_gateway(cluster, config()))
    raw = b'{"input_ids": [' + b"[1]," * MAX_BATCH + b"[2]]}"
    answer = await inference.handle("/generate", None, raw)
    assert isinstance(answer, Answer)
    assert answer.status == 400
    message = json.loads(answer.body)["error"]["message"]
    assert message == f"a batch holds at most {MAX_BATCH} elements ('n' or the list), not 4097"
    assert cluster.inference() == []


async def test_a_long_text_is_tokenized_off_the_event_loop() -> None:
    threads: list[int] = []

    class ThreadNoting(ByteTokenizer):
        def encode(self, text: str) -> list[int]:
            threads.append(threading.get_ident())
            return super().encode(text)

    tokenizer = ThreadNoting()
    gateway = await make_gateway(Cluster(), config(), tokenizer=tokenizer)
    inference = Inference(gateway)
    for text in ("short", "x" * TOKENIZE_INLINE_MAX):
        raw = json.dumps({"text": text}).encode()
        assert (await inference.handle("/generate", None, raw)).status == 200
    here = threading.get_ident()
    assert (threads[0] == here, threads[1] != here) == (True, True)


@SERVER_ONLY
async def test_values_orjson_would_change_reach_the_workers_as_sent(front: str) -> None:
    cluster = Cluster()
    gateway = await make_gateway(cluster, config())
    raw = b'{"input_ids": [1], "t": NaN, "u": -Infinity, "big": 123456789012345678901234567890}'
    async with client_for(gateway, front) as client:
        response = await client.post("/generate", content=raw)
    assert response.status_code == 200
    for call in cluster.inference():
        assert math.isnan(call.body["t"])
        assert (call.body["u"], call.body["big"]) == (-math.inf, 123456789012345678901234567890)


@SERVER_ONLY
async def test_inference_paths_take_post_only(front: str) -> None:
    gateway = await make_gateway(Cluster(), config())
    async with client_for(gateway, front) as client:
        response = await client.get("/v1/chat/completions")
    assert (response.status_code, response.headers["allow"]) == (405, "POST")
    assert "takes POST" in response.json()["error"]["message"]


@SERVER_ONLY
async def test_api_key_is_required(setup: tuple[Cluster, Gateway], front: str) -> None:
    _, gateway = setup
    async with client_for(gateway, front) as client:
        assert (await client.post("/generate", json={"text": "x"})).status_code == 401
        wrong = {"authorization": "Bearer nope"}
        assert (
            await client.post("/generate", json={"text": "x"}, headers=wrong)
        ).status_code == 401
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/liveness")).status_code == 200


@SERVER_ONLY
async def test_streaming_through_the_app(setup: tuple[Cluster, Gateway], front: str) -> None:
    cluster, gateway = setup

    async def sse() -> AsyncIterator[bytes]:
        for token in (b"data: a\n\n", b"data: b\n\n", b"data: [DONE]\n\n"):
            yield token

    async def decode(_: httpx.Request, __: Any) -> httpx.Response:
        return httpx.Response(200, content=sse(), headers={"content-type": "text/event-stream"})

    for url in DECODES:
        cluster.on(url, decode)
    async with client_for(gateway, front) as client:
        response = await client.post("/generate", json={"text": "x", "stream": True}, headers=AUTH)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.content == b"data: a\n\ndata: b\n\ndata: [DONE]\n\n"
    await gateway.calls.drain()
    assert all(v.in_flight == 0 for v in gateway.loads.loads.values())


async def test_workers_admin_api(setup: tuple[Cluster, Gateway], front: str) -> None:
    _, gateway = setup
    admin = {"authorization": "Bearer admin"}
    async with client_for(gateway, front) as client:
        listed = (await client.get("/workers", headers=AUTH)).json()["workers"]
        assert {w["id"] for w in listed} == {u.split("//")[1] for u in (*PREFILLS, *DECODES)}
        new = {"url": "http://10.0.0.3:30001", "worker_type": "prefill", "bootstrap_port": 9000}
        assert (await client.post("/workers", json=new, headers=AUTH)).status_code == 401
        added = await client.post("/workers", json=new, headers=admin)
        assert added.status_code == 201
        assert added.json()["pod"] == "10.0.0.3:30001"
        assert added.json()["directory"] == "pending"
        assert (await client.post("/workers", json=new, headers=admin)).status_code == 409
        bad = await client.post(
            "/workers", json={"url": "ftp://x", "role": "decode"}, headers=admin
        )
        assert bad.status_code == 400
        assert "http(s) URL" in bad.json()["error"]["message"]
        mixed = {"url": "http://d:1", "role": "decode", "bootstrap_port": 5}
        assert (await client.post("/workers", json=mixed, headers=admin)).status_code == 400
        one = await client.get("/workers/http://10.0.0.3:30001", headers=AUTH)
        assert one.json()["bootstrap_port"] == 9000
        assert (await client.get("/workers/nope:1", headers=AUTH)).status_code == 404
        assert (await client.delete("/workers/10.0.0.3:30001", headers=AUTH)).status_code == 401
        removed = await client.delete("/workers/10.0.0.3:30001", headers=admin)
        assert removed.json() == {"removed": "10.0.0.3:30001"}
        assert gateway.pool.get("10.0.0.3:30001") is None


@SERVER_ONLY
async def test_a_prefill_that_answered_shows_its_measured_rate(front: str) -> None:
    """/workers and /metrics show what the prefix policy weighs: the rate a prefill was
    measured at (the prompt's tokens in 0.5 s of the gateway's clock), and the tokens still
    estimated ahead of it (none once it answered)."""
    cluster, clock = Cluster(), FakeClock()

    async def half_a_second(_: httpx.Request, __: Any) -> httpx.Response:
        clock.now += 0.5
        return httpx.Response(200, json={})

    for url in PREFILLS:
        cluster.on(url, half_a_second)
    gateway = await make_gateway(
        cluster, config(), lookup=StubLookup(), tokenizer=ByteTokenizer(), clock=clock
    )
    async with client_for(gateway, front) as client:
        await client.post("/generate", json={"text": "hello"})
        listed = (await client.get("/workers")).json()["workers"]
        text = (await client.get("/metrics")).text
    prefills = [w for w in listed if w["role"] == "prefill"]
    measured = [w for w in prefills if w["prefill_tokens_per_s"] is not None]
    expected = len(ByteTokenizer().encode("hello")) / 0.5
    assert [w["prefill_tokens_per_s"] for w in measured] == [expected]
    assert [w["remaining_prefill_tokens"] for w in prefills] == [0, 0]
    rate = "globalkv_gateway_worker_prefill_tokens_per_second"
    assert text.count(f"{rate}{{") == 1, "a worker never timed has no rate"
    assert f'{rate}{{role="prefill",worker="{measured[0]["id"]}"}} {expected}' in text


async def test_the_settings_in_force_are_shown_without_secrets(
    setup: tuple[Cluster, Gateway], front: str
) -> None:
    _, gateway = setup
    async with client_for(gateway, front) as client:
        assert (await client.get("/v1/config")).status_code == 401
        shown = await client.get("/v1/config", headers={"authorization": "Bearer admin"})
        assert (await client.get("/v1/config", headers=AUTH)).json() == shown.json()
    settings = shown.json()
    assert (settings["prefill_policy"], settings["decode_policy"]) == ("prefix", "power_of_two")
    assert settings["prefix"] == {
        "uncached_weight": 1.0,
        "queued_weight": 0.5,
        "request_cost": 0.0,
        "pressure_weight": 2.0,
        "pending_grace_secs": 2.0,
        "session_ttl_secs": 600.0,
        "sessions_max": 100_000,
    }
    assert (settings["index"], settings["model"], settings["model_in_use"]) == (None, "m", "m")
    assert (settings["tokenizer"], settings["tokenizer_loaded"]) == (None, True)
    assert (settings["api_key_set"], settings["admin_token_set"]) == (True, True)
    assert "prefill" not in settings
    assert '"k"' not in shown.text
    assert '"admin"' not in shown.text


async def test_the_index_is_shown_by_kind_and_redis_without_credentials() -> None:
    cfg = config(redis_url="redis://:secret@r:6379/0", block_size=16, tokenizer="byte")
    redis = (await make_gateway(Cluster(), cfg)).effective_config()
    assert (redis["index"], redis["redis_url"], redis["redis_prefix"]) == (
        "redis",
        "redis://r:6379/0",
        "gkv",
    )
    assert redis["tokenizer"] == "byte"
    cfg = config(indexer_url="http://ix:8100", indexer_token="t")
    indexer = (await make_gateway(Cluster(), cfg)).effective_config()
    assert (indexer["index"], indexer["indexer_url"], indexer["indexer_token_set"]) == (
        "indexer",
        "http://ix:8100",
        True,
    )
    assert "indexer_token" not in indexer


async def test_settings_left_to_a_derived_default_show_the_value_in_force(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://u:pw@collector:4318")
    shown = (await make_gateway(Cluster(), config(max_payload_size=300 << 20))).effective_config()
    assert shown["max_buffered_payload_size"] == 600 << 20, "twice --max-payload-size"
    assert shown["max_client_connections"] == default_max_connections()
    assert shown["otlp_traces_endpoint"] == "http://u:***@collector:4318"
    given = config(max_buffered_payload_size=1 << 30, max_client_connections=7)
    shown = (await make_gateway(Cluster(), given)).effective_config()
    assert (shown["max_buffered_payload_size"], shown["max_client_connections"]) == (1 << 30, 7)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT")
    assert (await make_gateway(Cluster(), config())).effective_config()[
        "otlp_traces_endpoint"
    ] is None


async def test_readiness_and_metrics(setup: tuple[Cluster, Gateway], front: str) -> None:
    cluster, gateway = setup
    async with client_for(gateway, front) as client:
        assert (await client.get("/readiness")).json() == {
            "ready": True,
            "eligible": {"prefill": 2, "decode": 2},
        }
        for url in DECODES:
            gateway.pool.remove(url.split("//")[1])
        assert (await client.get("/readiness")).status_code == 503
        text = (await client.get("/metrics")).text
    assert "globalkv_gateway_worker_healthy" in text
    assert (
        'globalkv_gateway_directory_ready{pod="10.0.0.1:30001",worker="10.0.0.1:30001"} 1.0' in text
    )
    assert cluster.inference() == []


async def test_info_endpoints_are_proxied(setup: tuple[Cluster, Gateway], front: str) -> None:
    cluster, gateway = setup
    cluster.server_info[DECODES[0].split("//")[1]] = {"version": "x"}
    cluster.server_info[DECODES[1].split("//")[1]] = {"version": "x"}
    async with client_for(gateway, front) as client:
        info = await client.get("/get_server_info", headers=AUTH)
        models = await client.get("/v1/models", headers=AUTH)
    assert info.json() == {"version": "x"}
    assert models.status_code == 404, "the fake decode has no /v1/models: its answer is passed on"


async def test_an_info_endpoint_skips_a_worker_it_cannot_reach(front: str) -> None:
    cluster = Cluster()
    gateway = await make_gateway(cluster, config())
    first, second = (w.id for w in gateway.pool.eligible("decode"))
    cluster.server_info[second] = {"version": "x"}
    cluster.down.add(first)
    async with client_for(gateway, front) as client:
        assert (await client.get("/get_server_info")).json() == {"version": "x"}
        cluster.down.update(w.id for w in gateway.pool)
        answer = await client.get("/get_server_info")
    assert answer.status_code == 502
    message = answer.json()["error"]["message"]
    assert message.startswith(f"no worker could be reached: {first} (ConnectError), {second}")


async def test_added_worker_is_checked_before_traffic() -> None:
    cluster = Cluster()
    gateway = await make_gateway(cluster, config(prefill=[], decode=[]))
    worker = gateway.add_worker(WorkerSpec(url=DECODES[0], role="decode"))
    assert not worker.eligible
    await gateway.monitor.run_once()
    assert worker.eligible
