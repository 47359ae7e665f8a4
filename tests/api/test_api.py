"""The index HTTP API: shapes, validation (4xx never 500), auth, 503 when it cannot answer."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest
import zmq.asyncio
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from globalkv.api import ApiConfig, create_app
from globalkv.index.base import Index, Source, SourceBatch, StoreBlocks, Tier
from globalkv.index.memory import MemoryIndex
from globalkv.ingest.service import IngestService
from globalkv.keys import EngineHash, request_keys, root_key
from globalkv.lookup import HttpLookup, IndexLookup
from globalkv.metrics import IngestMetrics
from globalkv.registry import MemoryRegistry, PodInfo, PodState
from globalkv.tokenize import ByteTokenizer, Tokenizer
from kvplumbing.release import VERSION
from tests.ingest.fakes import RecordingIndex

TOKEN = "s3cret"
AUTH = {"authorization": f"Bearer {TOKEN}"}
POD = {
    "id": "p0",
    "model": "m",
    "block_size": 8,
    "kv_events": {
        "endpoint": "tcp://127.0.0.1:5557",
        "replay_endpoint": "tcp://127.0.0.1:5558",
        "topic": "",
    },
    "url": "http://127.0.0.1:30001",
    "bootstrap_port": 8998,
}


@pytest.fixture
async def index() -> MemoryIndex:
    index = MemoryIndex(4)
    store = StoreBlocks(
        hashes=[EngineHash(1), EngineHash(2)],
        parent=None,
        token_ids=list(range(1, 9)),
        block_size=4,
        tier=Tier.GPU,
        namespace=root_key("m"),
    )
    await index.apply(SourceBatch(Source("p0", 1), 0, 1.0, [store]))
    text = StoreBlocks(
        hashes=[EngineHash(7)],
        parent=None,
        token_ids=ByteTokenizer().encode("abcdefg")[:4],
        block_size=4,
        tier=Tier.CPU,
        namespace=root_key("m"),
    )
    await index.apply(SourceBatch(Source("p1", 0), 0, 1.0, [text]))
    return index


async def _client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://indexer")


def _app(
    index: Index,
    *,
    config: ApiConfig | None = None,
    ready: bool = True,
    resyncing: int = 0,
    tokenizer: Tokenizer | None = None,
) -> FastAPI:
    """The API over `index`, with a stand-in ingest that only says whether it is ready."""
    resyncing_sources = {Source("p", rank) for rank in range(resyncing)}
    ingest = SimpleNamespace(
        recovery=SimpleNamespace(ready=ready, resyncing=resyncing_sources, held={}),
        following=SimpleNamespace(pods=list),
    )
    return create_app(
        config or ApiConfig(),
        index=index,
        registry=MemoryRegistry(),
        ingest=cast(IngestService, ingest),
        metrics_registry=CollectorRegistry(),
        tokenizer=tokenizer,
    )


def _following_app(
    index: Index, registry: MemoryRegistry, context: zmq.asyncio.Context
) -> tuple[IngestService, FastAPI]:
    """The API over a real ingest service (which the caller stops), default limits."""
    ingest = IngestService(index, registry, IngestMetrics(CollectorRegistry()), context=context)
    app = create_app(
        ApiConfig(),
        index=index,
        registry=registry,
        ingest=ingest,
        metrics_registry=CollectorRegistry(),
    )
    return ingest, app


@pytest.fixture
async def setup(
    index: MemoryIndex, context: zmq.asyncio.Context
) -> AsyncIterator[tuple[httpx.AsyncClient, IngestService, CollectorRegistry]]:
    prom = CollectorRegistry()
    registry = MemoryRegistry()
    ingest = IngestService(index, registry, IngestMetrics(prom), context=context)
    app = create_app(
        # lookups opened: who may read them is tests/api/test_protected.py's
        ApiConfig(admin_token=TOKEN, open_lookups=True, max_body_bytes=64 * 1024, max_tokens=1000),
        index=index,
        registry=registry,
        ingest=ingest,
        metrics_registry=prom,
        tokenizer=ByteTokenizer(),
    )
    async with await _client(app) as client:
        yield client, ingest, prom
    await ingest.stop()


@pytest.fixture
def client(setup: tuple[httpx.AsyncClient, IngestService, CollectorRegistry]) -> httpx.AsyncClient:
    return setup[0]


async def test_lookup_answers_in_the_lookup_result_shape(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/lookup", json={"model": "m", "token_ids": list(range(1, 12))})
    assert response.status_code == 200
    assert response.json() == {
        "block_size": 4,
        "blocks": 2,
        "pods": [{"pod": "p0", "dp_rank": 1, "hit_blocks": 2, "hit_tokens": 8, "score": 2.0}],
    }


async def test_http_lookup_reads_back_what_index_lookup_computes(
    client: httpx.AsyncClient, index: MemoryIndex
) -> None:
    tokens = list(range(1, 9))
    remote = await HttpLookup(client, "http://indexer").lookup("m", tokens)
    local = await IndexLookup(index).lookup("m", tokens)
    assert remote == local
    assert list(remote.keys) == list(local.keys) == request_keys(tokens, 4, "m"), (
        "the keys the gateway records as pending, keyed here with the indexer's block size"
    )


async def test_other_namespaces_miss(client: httpx.AsyncClient) -> None:
    for body in (
        {"model": "other", "token_ids": list(range(1, 9))},
        {"model": "m", "token_ids": list(range(1, 9)), "lora_name": "adapter"},
        {"model": "m", "token_ids": list(range(1, 9)), "cache_salt": "salt"},
    ):
        response = await client.post("/v1/lookup", json=body)
        assert response.status_code == 200
        assert response.json()["pods"] == []


async def test_text_lookup_uses_the_tokenizer(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/lookup", json={"model": "m", "text": "abcdefg"})
    assert response.status_code == 200
    assert [p["pod"] for p in response.json()["pods"]] == ["p1"]


class _ThreadRecordingTokenizer(ByteTokenizer):
    def __init__(self) -> None:
        super().__init__()
        self.threads: list[int] = []

    def encode(self, text: str) -> list[int]:
        self.threads.append(threading.get_ident())
        return super().encode(text)


async def test_text_is_tokenized_off_the_event_loop(index: MemoryIndex) -> None:
    tokenizer = _ThreadRecordingTokenizer()
    async with await _client(_app(index, tokenizer=tokenizer)) as client:
        response = await client.post("/v1/lookup", json={"model": "m", "text": "abcdefg"})
    assert [p["pod"] for p in response.json()["pods"]] == ["p1"]
    assert len(tokenizer.threads) == 1
    assert tokenizer.threads[0] != threading.get_ident()


async def test_text_without_tokenizer_is_400(index: MemoryIndex) -> None:
    app = _app(index)
    async with await _client(app) as client:
        response = await client.post("/v1/lookup", json={"model": "m", "text": "abc"})
    assert response.status_code == 400
    assert "tokenizer" in response.json()["detail"]


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m"},
        {"model": "m", "token_ids": [1], "text": "a"},
        {"model": "m", "token_ids": [-1]},
        {"model": "m", "token_ids": [2**32]},
        {"model": "m", "token_ids": ["a"]},
        {"model": "m", "token_ids": [1.5]},
        {"model": "m", "token_ids": "1,2"},
        {"token_ids": [1]},
        {"model": "m", "token_ids": [1], "unknown": 1},
        {"model": 5, "token_ids": [1]},
        [1, 2],
        None,
    ],
)
async def test_bad_lookup_bodies_are_422(client: httpx.AsyncClient, body: object) -> None:
    response = await client.post("/v1/lookup", json=body)
    assert response.status_code == 422
    assert response.json()["detail"]


async def test_unparseable_json_is_4xx(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/lookup", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 422


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        ("/v1/lookup", b'{"model": "m", "token_ids": [NaN]}'),
        ("/v1/lookup", b'{"model": "m", "token_ids": [-Infinity]}'),
        ("/v1/lookup", b'{"model": "m", "token_ids": [1e400]}'),
        ("/v1/lookup", b'{"model": "\\ud800", "token_ids": [1]}'),
        ("/v1/lookup", b"NaN"),
        ("/v1/pods", b'{"id": "p", "dp_size": NaN, "kv_events": {"endpoint": "tcp://h:1"}}'),
        ("/v1/pods", b'{"id": "\\ud800", "kv_events": {"endpoint": "tcp://h:1"}}'),
    ],
)
async def test_values_json_cannot_echo_are_422_not_500(
    client: httpx.AsyncClient, path: str, raw: bytes
) -> None:
    """FastAPI's own 422 echoes the offending values, and the answer failed on these."""
    headers = {"content-type": "application/json", "authorization": f"Bearer {TOKEN}"}
    response = await client.post(path, content=raw, headers=headers)
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"][0] == "body"
    assert "input" not in response.json()["detail"][0]


async def test_too_many_tokens_is_413(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/lookup", json={"model": "m", "token_ids": [1] * 1001})
    assert response.status_code == 413
    assert "1001 tokens" in response.json()["detail"]


async def test_oversized_body_is_413_by_header_and_by_stream(client: httpx.AsyncClient) -> None:
    big = b'{"model": "m", "token_ids": [' + b"1," * 40_000 + b"1]}"
    response = await client.post(
        "/v1/lookup", content=big, headers={"content-type": "application/json"}
    )
    assert response.status_code == 413

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(big), 8192):
            yield big[start : start + 8192]

    response = await client.post(
        "/v1/lookup", content=chunks(), headers={"content-type": "application/json"}
    )
    assert response.status_code == 413


async def test_index_unavailable_is_503() -> None:
    index = RecordingIndex(unavailable=1)
    app = _app(index)
    async with await _client(app) as client:
        response = await client.post("/v1/lookup", json={"model": "m", "token_ids": [1] * 8})
    assert response.status_code == 503
    assert "unavailable" in response.json()["detail"]


async def test_resyncing_index_is_503_on_lookup_and_health(index: MemoryIndex) -> None:
    app = _app(index, ready=False, resyncing=3)
    async with await _client(app) as client:
        response = await client.post("/v1/lookup", json={"model": "m", "token_ids": [1] * 8})
        assert response.status_code == 503
        assert "resyncing" in response.json()["detail"]
        health = await client.get("/health")
    assert health.status_code == 503
    assert health.json() == {
        "status": "resyncing",
        "version": VERSION,
        "pods": 0,
        "resyncing_sources": 3,
        "held_sources": 0,
        "reason": "sources are rebuilt after the index lost data",
    }


async def test_pods_need_the_admin_token(client: httpx.AsyncClient) -> None:
    assert (await client.post("/v1/pods", json=POD)).status_code == 401
    wrong = {"authorization": "Bearer nope"}
    assert (await client.post("/v1/pods", json=POD, headers=wrong)).status_code == 401
    assert (await client.delete("/v1/pods/p0")).status_code == 401
    latin = {"authorization": "Bearer s\xe9cret".encode("latin-1")}
    assert (await client.post("/v1/pods", json=POD, headers=latin)).status_code == 401


async def test_a_non_ascii_admin_token_is_compared_as_utf8_bytes(index: MemoryIndex) -> None:
    app = _app(index, config=ApiConfig(admin_token="s\xe9cret"))
    async with await _client(app) as client:
        right = {"authorization": "Bearer s\xe9cret".encode()}
        wrong = {"authorization": "Bearer s\xe9cret".encode("latin-1")}
        assert (await client.post("/v1/pods", json={}, headers=wrong)).status_code == 401
        assert (await client.post("/v1/pods", json={}, headers=right)).status_code == 422


async def test_add_list_and_delete_a_pod(
    setup: tuple[httpx.AsyncClient, IngestService, CollectorRegistry], index: MemoryIndex
) -> None:
    client, ingest, _ = setup
    response = await client.post("/v1/pods", json=POD, headers=AUTH)
    assert response.status_code == 201
    assert response.json()["kv_events"]["endpoint"] == POD["kv_events"]["endpoint"]  # type: ignore[index]
    assert [p.id for p in ingest.following.pods()] == ["p0"]
    listed = (await client.get("/v1/pods")).json()["pods"]
    assert [p["id"] for p in listed] == ["p0"]
    assert listed[0]["state"]["subscribed"] is True
    assert listed[0]["bootstrap_port"] == 8998
    response = await client.delete("/v1/pods/p0", headers=AUTH)
    assert response.status_code == 200
    assert (await client.get("/v1/pods")).json() == {"pods": []}
    assert await index.stats("p0") == []
    assert (await client.delete("/v1/pods/p0", headers=AUTH)).status_code == 404


async def test_a_bound_topic_of_another_pod_is_409(client: httpx.AsyncClient) -> None:
    bound = {"id": "b0", "kv_events": {"mode": "bind", "topic": "kv@b0@m"}}
    assert (await client.post("/v1/pods", json=bound, headers=AUTH)).status_code == 201
    response = await client.post("/v1/pods", json={**bound, "id": "b1"}, headers=AUTH)
    assert response.status_code == 409
    assert "already names pod b0" in response.json()["detail"]
    assert [p["id"] for p in (await client.get("/v1/pods")).json()["pods"]] == ["b0"]


async def test_a_pod_removed_while_the_index_is_down_is_503_then_cleared(
    context: zmq.asyncio.Context,
) -> None:
    index = RecordingIndex()
    registry = MemoryRegistry()
    ingest, app = _following_app(index, registry, context)
    try:
        async with await _client(app) as client:
            assert (await client.post("/v1/pods", json=POD)).status_code == 201
            index.unavailable = 1
            response = await client.delete("/v1/pods/p0")
            assert response.status_code == 503
            assert "cleared once the index answers" in response.json()["detail"]
            assert (await client.get("/v1/pods")).json() == {"pods": []}
            await ingest.following.clear_removed()
            assert index.removed_pods == ["p0"]
    finally:
        await ingest.stop()


async def test_a_pod_this_indexer_does_not_follow_has_no_state(
    index: MemoryIndex, context: zmq.asyncio.Context
) -> None:
    """Not the registry's copy: that may be an earlier process's, saying subscribed."""
    registry = MemoryRegistry()
    await registry.put(PodInfo.model_validate(POD))
    await registry.put_states({"p0": PodState(subscribed=True, receiving=True)})
    ingest, app = _following_app(index, registry, context)
    async with await _client(app) as client:
        (pod,) = (await client.get("/v1/pods")).json()["pods"]
    assert (pod["id"], pod["state"]) == ("p0", None)
    await ingest.stop()


async def test_minimal_pod_and_model_from_topic(client: httpx.AsyncClient) -> None:
    body = {"id": "p1", "kv_events": {"endpoint": "tcp://127.0.0.1:1", "topic": "kv@p1@llama"}}
    response = await client.post("/v1/pods", json=body, headers=AUTH)
    assert response.status_code == 201
    assert response.json()["model"] == "llama"


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({**POD, "block_size": 6}, 400),
        ({**POD, "kv_events": {"endpoint": "tcp://*:5557"}}, 422),
        ({**POD, "kv_events": {"endpoint": "http://x"}}, 422),
        ({**POD, "kv_events": {}}, 422),
        ({**POD, "kv_events": {"mode": "bind"}}, 422),
        ({**POD, "id": "bad id/"}, 422),
        ({**POD, "id": ""}, 422),
        ({**POD, "dp_size": 0}, 422),
        ({**POD, "bootstrap_port": 70000}, 422),
        ({**POD, "surprise": True}, 422),
        ({"kv_events": {"endpoint": "tcp://127.0.0.1:1"}}, 422),
    ],
)
async def test_bad_pods_are_4xx(
    client: httpx.AsyncClient, body: dict[str, Any], status: int
) -> None:
    response = await client.post("/v1/pods", json=body, headers=AUTH)
    assert response.status_code == status
    assert response.json()["detail"]


async def test_health_and_metrics(client: httpx.AsyncClient) -> None:
    health = await client.get("/health")
    assert health.status_code == 200
    assert health.json()["status"] == "ok"
    await client.post("/v1/lookup", json={"model": "m", "token_ids": [1]})
    metrics = await client.get("/metrics")
    assert metrics.status_code == 200
    assert 'globalkv_api_requests_total{route="/v1/lookup",status="200"} 1.0' in metrics.text


async def test_openapi_documents_the_endpoints(client: httpx.AsyncClient) -> None:
    paths = (await client.get("/openapi.json")).json()["paths"]
    assert {"/v1/lookup", "/v1/pods", "/v1/pods/{pod_id}", "/health", "/metrics"} <= set(paths)


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(
            st.sampled_from(
                ["id", "model", "token_ids", "text", "kv_events", "endpoint", "dp_size"]
            )
            | st.text(max_size=5),
            children,
            max_size=6,
        )
    ),
    max_leaves=25,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=_json)
async def test_any_json_body_is_answered_without_a_server_error(
    client: httpx.AsyncClient, body: object
) -> None:
    for path in ("/v1/lookup", "/v1/pods"):
        response = await client.post(path, json=body, headers=AUTH)
        assert response.status_code < 500, (path, body, response.text)


async def test_the_gateway_s_lookups_carry_the_indexer_token(index: MemoryIndex) -> None:
    app = _app(index, config=ApiConfig(admin_token=TOKEN))
    async with await _client(app) as client:
        found = await HttpLookup(client, "http://indexer", token=TOKEN).lookup("m", [1, 2, 3, 4])
        assert [p.pod for p in found.pods] == ["p0"]


async def test_a_salted_chain_is_found_only_with_its_salt() -> None:
    """Whoever may look up learns nothing of a salted tenant's prompts without the salt."""
    index = MemoryIndex(4)
    salted = StoreBlocks(
        hashes=[EngineHash(1)],
        parent=None,
        token_ids=[1, 2, 3, 4],
        block_size=4,
        tier=Tier.GPU,
        namespace=root_key("m", None, "tenant-secret"),
    )
    await index.apply(SourceBatch(Source("p0"), 0, 1.0, [salted]))
    async with await _client(_app(index)) as client:
        for namespace in ({}, {"cache_salt": "tenant-guess"}, {"lora_name": "tenant-secret"}):
            body = {"model": "m", "token_ids": [1, 2, 3, 4], **namespace}
            assert (await client.post("/v1/lookup", json=body)).json()["pods"] == []
        body = {"model": "m", "token_ids": [1, 2, 3, 4], "cache_salt": "tenant-secret"}
        assert [p["pod"] for p in (await client.post("/v1/lookup", json=body)).json()["pods"]] == [
            "p0"
        ]
