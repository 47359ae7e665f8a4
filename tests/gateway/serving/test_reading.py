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


async def test_a_request_is_read_into_its_query_once() -> None:
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
    read = await reader.read("generate", body, picked, "Bearer k")
    query = read.query
    assert (query.tokens, query.session, query.prefill) == ([1, 2, 3], "chat-7", "10.0.0.9:30001")
    assert (query.kind, query.batch, query.model) == ("sglang", 2, "m")
    assert read.parsed.batch == 2
    assert read.flow is not None
    assert (read.flow.key.priority, read.flow.tokens, read.flow.query) == (10, 3, query)


async def test_what_an_entry_point_does_not_read_is_not_read() -> None:
    gateway = await make_gateway(Cluster(), config())
    reader = RequestReader(gateway.router, None)
    assert PREFILL not in reader.header_names
    body = json.dumps({"prompt": "hello there", "model": "m"}).encode()
    read = await reader.read("completions", body, {PREFILL: b"not a host"})
    assert (read.query.prefill, read.flow, read.query.kind) == (None, None, None)
    assert (read.query.tokens, read.query.missing) == (None, "no_tokenizer")
    named = RequestReader(gateway.router, None, named_prefill=True)
    with pytest.raises(BadRequest, match="x-globalkv-prefill must be host:port"):
        await named.read("completions", body, {PREFILL: b"not a host"})


async def test_the_picker_keeps_a_session_on_its_prefill_as_the_gateway_does() -> None:
    gateway = await make_gateway(Cluster(), config())
    picker = Picker(gateway)
    assert {"x-smg-routing-key", "x-dynamo-session-id"} <= picker.wanted_headers
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
