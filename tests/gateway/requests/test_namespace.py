"""LoRA adapters and cache salts: the namespace a request is looked up in, and the pods
that may serve it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.http.answer import Answer
from gateway.requests import namespace as namespace_module
from gateway.requests.bodies import BadRequest
from gateway.requests.namespace import (
    BASE,
    RequestNamespace,
    ServedAdapter,
    UnknownAdapter,
    request_namespace,
)
from gateway.serving.inference import Inference
from gateway.workers.kinds import served_adapters
from tests.gateway.fakes import DECODES, PREFILLS, Cluster, StubLookup, config, make_gateway

ADAPTERS = {
    ServedAdapter(name, "base", kind) for name in ("ad-a", "ad-b") for kind in ("vllm", "sglang")
} | {ServedAdapter("ad-a", "other-base", "sglang"), ServedAdapter("only-vllm", "base", "vllm")}
MODELS = {"base", "other-base", "s3://bucket:model"}


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"prompt": "x"}, BASE),
        ({"model": "base", "prompt": "x"}, RequestNamespace("base")),
        # vLLM: the adapter is the model
        ({"model": "ad-a"}, RequestNamespace("base", "ad-a", None, frozenset({"ad-a"}), "vllm")),
        (
            {"model": "ad-a", "cache_salt": "t"},
            RequestNamespace("base", "ad-a", "t", frozenset({"ad-a"}), "vllm"),
        ),
        ({"model": "base", "cache_salt": "t"}, RequestNamespace("base", None, "t")),
        ({"cache_salt": ""}, BASE),
        # SGLang: base:adapter wins over lora_path, which /generate and OpenAI bodies take
        (
            {"model": "base:ad-b", "lora_path": "ad-a"},
            RequestNamespace("base", "ad-b", None, frozenset({"ad-b"}), "sglang"),
        ),
        (
            {"lora_path": ["ad-a", None, "ad-b"], "cache_salt": ["t", "t"]},
            RequestNamespace("base", "ad-a", "t", frozenset({"ad-a", "ad-b"}), "sglang"),
        ),
        ({"model": "base:", "lora_path": ""}, RequestNamespace("base")),
        # a served name holding a colon names no adapter; an unknown base is a placeholder
        ({"model": "s3://bucket:model"}, RequestNamespace("s3://bucket:model")),
        ({"model": "other:ad-a"}, RequestNamespace("other:ad-a")),
        # an adapter of one name on several models: the one the request names
        (
            {"model": "other-base", "lora_path": "ad-a"},
            RequestNamespace("other-base", "ad-a", None, frozenset({"ad-a"}), "sglang"),
        ),
        # SGLang's extra_key: the events do not say it, so nothing is looked up
        ({"extra_key": "k"}, RequestNamespace(None, opaque=True)),
    ],
)
def test_the_namespace_is_read_as_each_engine_reads_it(
    body: dict[str, Any], expected: RequestNamespace
) -> None:
    assert request_namespace(body, ADAPTERS, MODELS) == expected


def test_a_model_alone_is_read_once_and_the_names_kept_are_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The namespace of a body naming only its model is kept by model (every chat completion
    names one), at most `_MODELS_KEPT` of them, since the client writes the names."""
    monkeypatch.setattr(namespace_module, "_OF_MODEL", {})
    first = request_namespace({"model": "kept-model"}, (), MODELS)
    assert first == RequestNamespace("kept-model")
    assert request_namespace({"model": "kept-model", "stream": True}, (), MODELS) is first
    for i in range(3 * namespace_module._MODELS_KEPT):
        name = f"client-model-{i}"
        assert request_namespace({"model": name}, (), MODELS) == RequestNamespace(name)
    assert len(namespace_module._OF_MODEL) == namespace_module._MODELS_KEPT


@pytest.mark.parametrize(
    "body",
    [
        {"lora_path": "nope"},
        {"model": "base:nope"},
        {"lora_path": ["ad-a", "nope"]},
        {"lora_path": "only-vllm"},  # served, but vLLM reads no lora_path
        {"model": "other-base:ad-b"},
    ],
)
def test_an_adapter_no_worker_serves_is_unknown(body: dict[str, Any]) -> None:
    with pytest.raises(UnknownAdapter, match="serves the LoRA adapter"):
        request_namespace(body, ADAPTERS, MODELS)


@pytest.mark.parametrize(
    "body",
    [{"cache_salt": 5}, {"lora_path": {"a": 1}}, {"extra_key": [1]}, {"cache_salt": "s" * 257}],
)
def test_a_namespace_field_of_the_wrong_type_is_a_bad_request(body: dict[str, Any]) -> None:
    with pytest.raises(BadRequest):
        request_namespace(body, ADAPTERS, MODELS)


def test_adapters_are_the_model_cards_with_another_parent() -> None:
    cards = [
        {"id": "base", "parent": None},
        {"id": "ad-a", "parent": "base", "root": "/adapters/a"},
        {"id": "self", "parent": "self"},
        {"id": 7, "parent": "base"},
        "junk",
    ]
    assert served_adapters({"data": cards}) == {"ad-a": "base"}
    assert served_adapters({"data": "x"}) == served_adapters([]) == {}


def models(*adapters: str) -> dict[str, Any]:
    cards = [{"id": "m", "parent": None}, *({"id": a, "parent": "m"} for a in adapters)]
    return {"object": "list", "data": cards}


async def adapter_cluster() -> tuple[Cluster, StubLookup, Inference]:
    """Prefill 0 and decode 0 serve adapter ad-a; the others none."""
    cluster = Cluster()
    for url in (PREFILLS[0], DECODES[0]):
        cluster.models[url.split("//")[1]] = models("ad-a")
    lookup = StubLookup()
    gateway = await make_gateway(cluster, config(), lookup=lookup)
    return cluster, lookup, Inference(gateway)


async def post(inference: Inference, path: str, body: dict[str, Any]) -> Answer:
    answer = await inference.handle(path, None, json.dumps(body).encode())
    assert isinstance(answer, Answer)
    return answer


async def test_an_adapter_request_goes_only_to_pods_that_serve_it_and_is_looked_up_there() -> None:
    cluster, lookup, inference = await adapter_cluster()
    bodies = [
        ("/v1/completions", {"model": "m:ad-a", "prompt": [1, 2, 3, 4], "cache_salt": "t"}),
        ("/generate", {"input_ids": [1, 2, 3, 4], "lora_path": "ad-a"}),
    ]
    for _ in range(4):
        for path, body in bodies:
            assert (await post(inference, path, body)).status == 200
    hosts = {call.worker for call in cluster.inference()}
    assert hosts == {PREFILLS[0].split("//")[1], DECODES[0].split("//")[1]}
    assert set(lookup.namespaces) == {("ad-a", "t"), ("ad-a", None)}
    assert {model for model, _ in lookup.asked} == {"m"}


async def test_an_adapter_loaded_later_is_served_once_the_monitor_has_seen_it() -> None:
    cluster = Cluster()
    for url in (PREFILLS[1], DECODES[1]):
        cluster.models[url.split("//")[1]] = models()
    gateway = await make_gateway(cluster, config())
    inference = Inference(gateway)
    body = {"model": "m:ad-b", "prompt": [1, 2]}
    assert (await post(inference, "/v1/completions", body)).status == 404
    for url in (PREFILLS[1], DECODES[1]):
        cluster.models[url.split("//")[1]] = models("ad-b")
    await gateway.monitor.run_once(force=True)
    assert (await post(inference, "/v1/completions", body)).status == 200
    hosts = {call.worker for call in cluster.inference()}
    assert hosts == {PREFILLS[1].split("//")[1], DECODES[1].split("//")[1]}


async def test_an_adapter_no_worker_serves_is_a_404_and_nothing_is_sent() -> None:
    cluster, _, inference = await adapter_cluster()
    answer = await post(inference, "/v1/completions", {"model": "m:ad-z", "prompt": [1]})
    assert answer.status == 404
    assert "ad-z" in json.loads(answer.body)["error"]["message"]
    assert cluster.inference() == []


async def test_a_salted_request_is_looked_up_under_its_salt_and_an_extra_key_not_at_all() -> None:
    _, lookup, inference = await adapter_cluster()
    await post(inference, "/v1/completions", {"prompt": [1, 2], "cache_salt": "tenant"})
    await post(inference, "/v1/completions", {"prompt": [1, 2], "extra_key": "k"})
    assert lookup.namespaces == [(None, "tenant")]


async def test_what_the_workers_serve_is_built_again_when_a_worker_comes_goes_or_changes() -> None:
    cluster = Cluster()
    cluster.models[PREFILLS[0].split("//")[1]] = models("ad-a")
    pool = (await make_gateway(cluster, config())).pool
    first = pool.served()
    assert pool.served() is first
    worker = next(iter(pool))
    worker.adapters = {**worker.adapters, "ad-new": "m"}
    pool.changed()  # as the monitor does when it finds them
    assert ServedAdapter("ad-new", "m", worker.kind) in pool.served().adapters
    worker.served_model = "another-base"
    pool.changed()
    assert "another-base" in pool.served().models
    pool.remove(worker.id)
    assert not pool.served().adapters
