"""vLLM's sequential PD dispatch through httpx.MockTransport: what each leg is sent, in
which order, and what a failure or a missing `kv_transfer_params` leads to."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from gateway.http.answer import Answer
from gateway.legs.vllm import decode_kv
from gateway.requests.bodies import parse_request
from gateway.requests.query import RouteQuery
from gateway.serving.service import Gateway
from gateway.settings.workers import WorkerSpec
from gateway.workers.kinds import detect_kind
from tests.gateway.fakes import (
    DECODES,
    PREFILLS,
    Cluster,
    config,
    make_gateway,
    request_of,
    rest_of,
    sample,
)

PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "engine-1",
    "remote_request_id": "req-1",
    "remote_block_ids": [0, 1, 2],
    "remote_host": "10.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
}
BODY = {
    "model": "m",
    "prompt": "hello",
    "max_tokens": 20,
    "max_completion_tokens": 20,
    "min_tokens": 3,
    "stream_options": {"include_usage": True},
    "kv_transfer_params": {"from": "the client"},
    "extra": {"keep": True},
}


def vllm_config(**overrides: Any) -> Any:
    return config(
        prefill=[WorkerSpec(url=u, role="prefill", kind="vllm") for u in PREFILLS],
        decode=[WorkerSpec(url=u, role="decode", kind="vllm") for u in DECODES],
        **overrides,
    )


async def send(gateway: Gateway, body: dict[str, Any], endpoint: Any = "completions") -> Any:
    return await gateway.dispatcher.forward(request_of(parse_request(endpoint, body)))


class Legs:
    """Prefills answering `params` (None: no params, an int: that status), decodes echoing
    what they got; each call's X-Request-Id and whether the prefill had answered."""

    def __init__(self, cluster: Cluster, params: Any = PARAMS, usage: Any = None) -> None:
        """`usage`: the decodes' whole answers carry it."""
        self.ids: list[tuple[str, str]] = []
        self.prefilled = 0
        self.decode_saw_prefilled: list[int] = []

        async def prefill(request: httpx.Request, _: Any) -> httpx.Response:
            self.ids.append(("prefill", request.headers["x-request-id"]))
            if isinstance(params, int):
                return httpx.Response(params, json={"error": "prefill refused"})
            self.prefilled += 1
            return httpx.Response(200, json={"choices": [], "kv_transfer_params": params})

        async def decode(request: httpx.Request, body: Any) -> httpx.Response:
            self.ids.append(("decode", request.headers["x-request-id"]))
            self.decode_saw_prefilled.append(self.prefilled)
            headers = {"x-request-id": request.headers["x-request-id"]}
            answer = {"got": body} if usage is None else {"got": body, "usage": usage}
            return httpx.Response(200, json=answer, headers=headers)

        for url in PREFILLS:
            cluster.on(url, prefill)
        for url in DECODES:
            cluster.on(url, decode)


async def test_the_prefill_gets_the_rewritten_request_then_the_decode_the_original() -> None:
    cluster = Cluster()
    legs = Legs(cluster)
    gateway = await make_gateway(cluster, vllm_config())
    answer = await send(gateway, BODY)
    assert isinstance(answer, Answer)
    assert answer.status == 200
    (prefill,), (decode,) = cluster.inference("prefill"), cluster.inference("decode")
    assert prefill.body == {
        "model": "m",
        "prompt": "hello",
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "extra": {"keep": True},
        "stream": False,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    }
    assert decode.body == {**BODY, "kv_transfer_params": PARAMS}
    assert json.loads(answer.body)["got"] == decode.body
    assert legs.decode_saw_prefilled == [1], "the decode was sent once the prefill answered"
    (_, first), (_, second) = legs.ids
    assert first == second
    assert len(first) == 32


async def test_a_stream_is_the_decodes_and_the_prefill_is_asked_not_to_stream() -> None:
    cluster = Cluster()
    legs = Legs(cluster)
    gateway = await make_gateway(cluster, vllm_config())
    outcome = await send(gateway, {"prompt": "hi", "stream": True})
    assert outcome.rest is not None
    rest = await rest_of(outcome)
    await outcome.rest.close("done")
    (prefill,), (decode,) = cluster.inference("prefill"), cluster.inference("decode")
    assert prefill.body["stream"] is False
    assert decode.body == {"prompt": "hi", "stream": True, "kv_transfer_params": PARAMS}
    assert json.loads(outcome.body + rest)["got"] == decode.body
    assert dict(outcome.headers)["x-request-id"] == legs.ids[0][1]


def _decodes(gateway: Gateway) -> dict[str, float | None]:
    counts = {
        kv: sample(gateway, "globalkv_gateway_vllm_prefilled_decodes_total", kv=kv)
        for kv in ("params", "prompt", "unreported")
    }
    counts["no_params"] = sample(
        gateway, "globalkv_gateway_vllm_recomputes_total", reason="no_params"
    )
    return {kv: count for kv, count in counts.items() if count}


async def test_a_decode_given_the_prefills_params_is_counted_as_prefilled() -> None:
    cluster = Cluster()
    Legs(cluster, usage={"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 0}})
    gateway = await make_gateway(cluster, vllm_config())
    assert (await send(gateway, BODY)).status == 200
    assert _decodes(gateway) == {"params": 1}


def _cached(tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": 48, "prompt_tokens_details": {"cached_tokens": tokens}}


async def test_without_params_the_decodes_own_answer_tells_whether_it_loaded_the_prompt() -> None:
    """A connector keeping the KV under the prompt hands no params (ExampleConnector): the
    decode that reports all but the tail past its last full block cached loaded it. One
    reporting more uncached computed the prompt. The decode's block size (16) comes
    from its /server_info."""
    for usage, counted in (
        (_cached(32), {"prompt": 1}),
        (_cached(48), {"prompt": 1}),
        (_cached(16), {"no_params": 1}),
        (_cached(0), {"no_params": 1}),
        ({"prompt_tokens": 48, "prompt_tokens_details": None}, {"unreported": 1}),
        (None, {"unreported": 1}),
    ):
        cluster = Cluster()
        for url in DECODES:
            cluster.server_info[url.split("//")[1]] = {"page_size": 16}
        Legs(cluster, params=None, usage=usage)
        gateway = await make_gateway(cluster, vllm_config())
        assert (await send(gateway, BODY)).status == 200
        (decode,) = cluster.inference("decode")
        assert "kv_transfer_params" not in decode.body
        assert _decodes(gateway) == counted, usage


async def test_a_streamed_decode_without_params_is_unreported() -> None:
    cluster = Cluster()
    Legs(cluster, params=None, usage=_cached(0))
    gateway = await make_gateway(cluster, vllm_config())
    outcome = await send(gateway, {"prompt": "hi", "stream": True})
    assert outcome.rest is not None
    await rest_of(outcome)
    await outcome.rest.close("done")
    assert _decodes(gateway) == {"unreported": 1}


def test_without_the_decodes_block_size_any_cached_token_counts_as_loaded() -> None:
    assert decode_kv(json.dumps({"usage": _cached(1)}).encode(), None) == "prompt"
    assert decode_kv(json.dumps({"usage": _cached(0)}).encode(), None) == "recomputed"
    for body in (b"not json", b"[]", b'{"usage": 3}', json.dumps({"usage": _cached(-1)}).encode()):
        assert decode_kv(body, 16) is None


async def test_a_failed_prefill_is_retried_on_the_other_and_the_decode_sent_once() -> None:
    cluster = Cluster()
    Legs(cluster)

    async def failing(_: httpx.Request, __: Any) -> httpx.Response:
        return httpx.Response(503, json={"error": "draining"})

    cluster.on(PREFILLS[0], failing)
    gateway = await make_gateway(cluster, vllm_config(prefill_policy="round_robin"))
    answer = await send(gateway, BODY)
    assert answer.status == 200
    prefills = [c.worker for c in cluster.inference("prefill")]
    assert prefills == [p.split("//")[1] for p in PREFILLS]
    assert len(cluster.inference("decode")) == 1
    retries = sample(
        gateway, "globalkv_gateway_retries_total", endpoint="completions", role="prefill"
    )
    assert retries == 1


async def test_without_any_prefills_answer_the_decode_is_never_sent() -> None:
    cluster = Cluster()
    Legs(cluster, params=500)
    gateway = await make_gateway(cluster, vllm_config())
    answer = await send(gateway, BODY)
    assert answer.status == 500
    assert len(cluster.inference("prefill")) == 5
    assert cluster.inference("decode") == []


async def test_allowed_recompute_sends_the_last_attempts_decode_without_params() -> None:
    cluster = Cluster()
    Legs(cluster, params=500)
    gateway = await make_gateway(cluster, vllm_config(vllm_allow_recompute=True))
    answer = await send(gateway, BODY)
    assert answer.status == 200
    assert len(cluster.inference("prefill")) == 5
    (decode,) = cluster.inference("decode")
    assert "kv_transfer_params" not in decode.body
    assert sample(gateway, "globalkv_gateway_vllm_recomputes_total", reason="prefill_failed") == 1
    assert _decodes(gateway) == {}, "no prefill answered"


async def test_a_prefill_client_error_is_answered_without_a_decode_or_retry() -> None:
    cluster = Cluster()
    Legs(cluster, params=400)
    gateway = await make_gateway(cluster, vllm_config(vllm_allow_recompute=True))
    answer = await send(gateway, BODY)
    assert answer.status == 400
    assert len(cluster.inference("prefill")) == 1
    assert cluster.inference("decode") == []


async def test_the_deadline_names_the_leg_it_stopped_in() -> None:
    cluster = Cluster()
    release = asyncio.Event()

    async def slow_prefill(_: httpx.Request, __: Any) -> httpx.Response:
        await release.wait()
        return httpx.Response(200, json={"kv_transfer_params": PARAMS})

    for url in PREFILLS:
        cluster.on(url, slow_prefill)
    cluster.hold_decodes(asyncio.Event())
    gateway = await make_gateway(cluster, vllm_config())
    for stage, calls in (("prefill", 1), ("decode", 2)):
        pending = asyncio.ensure_future(send(gateway, {"prompt": "x"}))
        await cluster.wait_calls(calls)
        if stage == "decode":
            release.set()
            await cluster.wait_calls(calls + 1)
        gateway.dispatcher.deadlines.expire_all()
        answer = await pending
        assert answer.status == 504
        assert json.loads(answer.body)["error"]["stage"] == stage
    await gateway.calls.drain()


async def test_sglangs_generate_is_never_sent_to_a_vllm_pair() -> None:
    cluster = Cluster()
    gateway = await make_gateway(cluster, vllm_config())
    answer = await send(gateway, {"text": "x"}, endpoint="generate")
    assert answer.status == 503
    assert "ready, sglang)" in json.loads(answer.body)["error"]["message"]
    assert cluster.inference() == []


async def test_pairs_stay_within_one_kind_in_a_mixed_pool() -> None:
    cluster = Cluster()
    Legs(cluster)
    cfg = config(
        prefill=[
            WorkerSpec(url=PREFILLS[0], role="prefill", kind="vllm"),
            WorkerSpec(url=PREFILLS[1], role="prefill", kind="sglang", bootstrap_port=8999),
        ],
        decode=[
            WorkerSpec(url=DECODES[0], role="decode", kind="sglang"),
            WorkerSpec(url=DECODES[1], role="decode", kind="vllm"),
        ],
        prefill_policy="round_robin",
    )
    gateway = await make_gateway(cluster, cfg)
    for _ in range(4):
        plan = gateway.router.plan(RouteQuery(None, "x"))
        assert plan.prefill.kind == plan.decode.kind
        assert (plan.prefill.url, plan.decode.url) in {
            (PREFILLS[0], DECODES[1]),
            (PREFILLS[1], DECODES[0]),
        }


def _worker(answers: dict[str, Any]) -> httpx.AsyncClient:
    async def handler(request: httpx.Request) -> httpx.Response:
        found = answers.get(request.url.path)
        return httpx.Response(404) if found is None else httpx.Response(200, json=found)

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


async def test_the_kind_is_read_from_models_then_server_info_then_version() -> None:
    models = {"data": [{"id": "llama", "object": "model", "owned_by": "vllm"}]}
    cases = [
        ({"/v1/models": models}, "vllm", "llama"),
        ({"/v1/models": {"data": [{"id": "q", "owned_by": "sglang"}]}}, "sglang", "q"),
        ({"/server_info": {"tp_size": 1, "disaggregation_mode": "prefill"}}, "sglang", None),
        ({"/version": {"version": "0.11.0"}}, "vllm", None),
        ({"/v1/models": {"data": []}, "/version": {"v": 1}}, None, None),
    ]
    for answers, kind, model in cases:
        async with _worker(answers) as client:
            found = await detect_kind(client, "http://w:1", 1.0)
        assert (found.kind, found.model) == (kind, model), answers
