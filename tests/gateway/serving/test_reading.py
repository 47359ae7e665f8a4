"""One reader for every entry point: what it reads of a request, and the gateway's
handler, a sidecar and the endpoint picker reading alike."""

from __future__ import annotations

import json

import pytest

from gateway.epp.picker import Pick, Picker
from gateway.flow.keys import FlowKeys
from gateway.requests.bodies import BadRequest
from gateway.serving.reading import RequestReader
from gateway.settings.flow import FlowConfig
from tests.gateway.fakes import Cluster, config, make_gateway

SESSION = b"x-smg-routing-key"
PREFILL = b"x-globalkv-prefill"


async def test_a_request_is_read_once_into_the_request_the_legs_serve() -> None:
    gateway = await make_gateway(Cluster(), config())
    flow = FlowKeys(FlowConfig(enabled=True, objectives=["premium=10/500"]))
    reader = RequestReader(gateway.router, None, flow, named_prefill=True)
    assert {SESSION, PREFILL, b"x-llm-d-inference-objective"} <= reader.header_names
    body = json.dumps({"input_ids": [[1, 2, 3], [4, 5]], "model": "m"}).encode()
    picked = {
        SESSION: b"chat-7",
        PREFILL: b"10.0.0.9:30001 ",
        b"x-llm-d-inference-objective": b"premium",
    }
    context = ((b"traceparent", b"00-1-2-01"),)
    request, flow = await reader.read("/generate", body, picked, "Bearer k", "id-7", context)
    query = request.query
    assert (query.tokens, query.session, query.prefill) == ([1, 2, 3], "chat-7", "10.0.0.9:30001")
    assert (query.kind, query.batch, query.model) == ("sglang", 2, "m")
    assert (request.path, request.parsed.endpoint, request.parsed.batch) == (
        "/generate",
        "generate",
        2,
    )
    assert (request.request_id, request.trace_context) == ("id-7", context)
    assert flow is not None
    assert (flow.key.priority, flow.tokens, flow.query) == (10, 3, query)


async def test_what_an_entry_point_does_not_read_is_not_read() -> None:
    gateway = await make_gateway(Cluster(), config())
    reader = RequestReader(gateway.router, None)
    assert PREFILL not in reader.header_names
    body = json.dumps({"prompt": "hello there", "model": "m"}).encode()
    request, flow = await reader.read("/v1/completions", body, {PREFILL: b"not a host"})
    query = request.query
    assert (query.prefill, flow, query.kind) == (None, None, None)
    assert (query.tokens, query.missing) == (None, "no_tokenizer")
    assert (request.request_id, request.trace_context) == (None, ())
    named = RequestReader(gateway.router, None, named_prefill=True)
    with pytest.raises(BadRequest, match="x-globalkv-prefill must be host:port"):
        await named.read("/v1/completions", body, {PREFILL: b"not a host"})


async def test_the_picker_keeps_a_session_on_its_prefill_as_the_gateway_does() -> None:
    gateway = await make_gateway(Cluster(), config())
    picker = Picker(gateway)
    assert {"x-smg-routing-key", "x-dynamo-session-id"} <= picker.headers.wanted
    body = json.dumps({"input_ids": [1, 2, 3, 4], "model": "m"}).encode()
    session = {"x-smg-routing-key": "conv"}
    first = await picker.pick("/generate", body, None, session)
    again = await picker.pick("/generate", body, None, session)
    other = await picker.pick("/generate", body, None, {})
    assert isinstance(first, Pick)
    assert isinstance(again, Pick)
    assert isinstance(other, Pick)
    assert dict(again.headers) == dict(first.headers), "kept on its prefill, busier as it is"
    assert dict(other.headers) != dict(first.headers), "without a session: the idle prefill"
