"""The picker refuses as the gateway does: for the same refusal the client gets the same
status, the same OpenAI error object (`{"error": {"message", "type", "param", "code"}}`,
`code` naming a limit where the gateway names one) and the same head lines, whichever of
the two it went through (but the request id, which Envoy gives its own). Refusals only
the picker makes keep that shape."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingResponse

from gateway.epp.stream import _outcome
from gateway.http.answer import Answer, problem
from gateway.serving.inference import Inference
from gateway.settings.edge import AdmissionConfig
from gateway.settings.flow import FlowConfig
from gateway.settings.workers import WorkerSpec
from tests.entry.ext_proc import completion, request, serve_epp, status
from tests.gateway.fakes import PREFILLS, Cluster, config, make_gateway

pytestmark = pytest.mark.timeout(30)
WHOLE = [WorkerSpec(url=u, role="prefill") for u in PREFILLS]


Refused = tuple[int, dict[str, Any], dict[str, str]]
"""A refusal as the client sees it: status, JSON body, head lines."""


def _picker_refusal(answer: ProcessingResponse) -> Refused:
    immediate = answer.immediate_response
    headers = {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers}
    return status(answer), json.loads(immediate.body), headers


def _gateway_refusal(answer: Answer) -> Refused:
    """As the gateway answers: its request id left out, which Envoy sets itself."""
    headers = {"content-type": answer.media_type.decode(), **dict(answer.headers)}
    headers.pop("x-request-id")
    return answer.status, json.loads(answer.body), headers


async def _by_the_gateway(body: bytes, *, one_held: bool = False, **settings: Any) -> Refused:
    """The gateway's answer to `body` with `settings`; `one_held`: while another request
    holds its place (its decode not answering yet)."""
    cluster = Cluster()
    release = asyncio.Event()
    cluster.hold_decodes(release)
    handler = Inference(await make_gateway(cluster, config(**settings)))
    first = None
    if one_held:
        first = asyncio.ensure_future(handler.handle("/v1/completions", None, completion()))
        async with asyncio.timeout(10):
            await cluster.wait_calls(2)  # its prefill and its decode
    try:
        return _gateway_refusal(await handler.handle("/v1/completions", None, body))
    finally:
        release.set()
        if first is not None:
            assert (await first).status == 200


async def _by_the_picker(body: bytes, *, one_held: bool = False, **settings: Any) -> Refused:
    """The picker's answer to `body` with `settings`, over aggregated workers; `one_held`:
    while another stream holds its pick."""
    gateway = await make_gateway(Cluster(), config(prefill=WHOLE, decode=[], **settings))
    async for epp in serve_epp(gateway):
        held = epp.stub.Process()
        if one_held:
            for message in request(completion()):
                await held.write(message)
            await held.read()  # picked: its place is held until its stream ends
        (answer,) = await epp.exchange(request(body))
        await held.done_writing()
        return _picker_refusal(answer)
    raise AssertionError("the picker did not serve")


@pytest.mark.parametrize(
    "body",
    [b"{not json", json.dumps({"model": "m", "max_tokens": 2}).encode(), completion(n=0)],
)
async def test_a_bad_request_is_refused_alike(body: bytes) -> None:
    ours = await _by_the_gateway(body)
    assert ours[0] == 400
    assert await _by_the_picker(body) == ours


@pytest.mark.parametrize("flow", [False, True])
async def test_a_full_queue_is_refused_alike(flow: bool) -> None:
    """sglang-router's admission queue, or flow control's: the same 429, body and
    Retry-After."""
    limit = AdmissionConfig(max_concurrent_requests=1, queue_size=0)
    settings = {"admission": limit, "flow": FlowConfig(enabled=flow)}
    ours = await _by_the_gateway(completion(), one_held=True, **settings)
    assert ours[0] == 429
    assert ours[1]["error"]["code"] == ("queue_full" if flow else None)
    assert "retry-after" in ours[2]
    assert await _by_the_picker(completion(), one_held=True, **settings) == ours


async def test_the_pickers_own_refusals_are_openai_error_objects() -> None:
    gateway = await make_gateway(Cluster(), config(prefill=WHOLE, decode=[], max_payload_size=1000))
    async for epp in serve_epp(gateway):
        too_large = await epp.exchange(request(b"x" * 3000, pieces=3))
        for worker in list(gateway.pool):
            gateway.pool.remove(worker.id)
        nowhere = await epp.exchange(request(completion()))
    for answer, code, kind in (
        (too_large[0], 413, "invalid_request_error"),
        (nowhere[0], 503, "no_available_workers"),
    ):
        got, body, headers = _picker_refusal(answer)
        assert (got, headers["content-type"]) == (code, "application/json")
        message = body["error"]["message"]
        assert body == {"error": {"message": message, "type": kind, "param": None, "code": None}}
    assert "--max-payload-size (1000 bytes)" in _picker_refusal(too_large[0])[1]["error"]["message"]


@pytest.mark.parametrize(
    ("answer", "outcome"),
    [
        (problem(429, "every endpoint is full", "overloaded"), "shed"),
        (problem(429, "the queue is full", "rate_limit_exceeded"), "queue_full"),
        (Answer(429, b"not json"), "queue_full"),
        (Answer(429, b"[1, 2]"), "queue_full"),
        (Answer(429, b'{"error": "overloaded"}'), "queue_full"),
        (Answer(429, b'{"error": {"type": ["overloaded"]}}'), "queue_full"),
        (problem(503, "no pod"), "no_endpoint"),
    ],
)
def test_a_refusal_is_counted_by_what_refused_it_whatever_its_body(
    answer: Answer, outcome: str
) -> None:
    assert _outcome(answer) == outcome
