"""The endpoint picker's ext_proc stream, spoken to as Envoy speaks it, over real gRPC.

The picker runs on a gateway over fake workers (`tests.gateway.fakes`), so what it chooses
and the load it holds are the gateway's own; each test opens ext_proc streams on a grpc.aio
server bound to a free loopback port and reads what Envoy would read.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, Metadata
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
)
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub
from google.protobuf.struct_pb2 import Struct
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from gateway.config import WorkerSpec
from gateway.epp.picker import Picker
from gateway.epp.protocol import BODY_PIECE_BYTES
from gateway.epp.server import EXT_PROC_SERVICE, EppMetrics, grpc_server
from gateway.service import Gateway
from globalkv.lookup import LookupResult, PodHit
from tests.gateway.fakes import DECODES, PREFILLS, Cluster, StubLookup, config, make_gateway
from tests.support.net import free_port

pytestmark = pytest.mark.timeout(30)
A, B = (u.split("//", 1)[1] for u in PREFILLS)
D0, D1 = (u.split("//", 1)[1] for u in DECODES)


def _headers(path: str = "/v1/completions", *, end: bool = False, **extra: str) -> HttpHeaders:
    pairs = {":method": "POST", ":path": path, "content-type": "application/json", **extra}
    values = [HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    return HttpHeaders(headers=HeaderMap(headers=values), end_of_stream=end)


def _metadata(namespace: str, fields: dict[str, Any]) -> Metadata:
    value = Struct()
    value.update(fields)
    metadata = Metadata()
    metadata.filter_metadata[namespace].CopyFrom(value)
    return metadata


def _request(body: bytes, *, pieces: int = 1, subset: Sequence[str] | None = None) -> list[Any]:
    hint = {} if subset is None else {"x-gateway-destination-endpoint-subset": list(subset)}
    metadata = _metadata("envoy.lb.subset_hint", hint) if subset is not None else Metadata()
    out: list[Any] = [ProcessingRequest(request_headers=_headers(), metadata_context=metadata)]
    size = max(1, -(-len(body) // pieces))
    for start in range(0, len(body), size):
        last = start + size >= len(body)
        out.append(
            ProcessingRequest(
                request_body=HttpBody(body=body[start : start + size], end_of_stream=last)
            )
        )
    return out


def _response(served: str | None = None, *, end: bool = False) -> ProcessingRequest:
    metadata = Metadata()
    if served is not None:
        metadata = _metadata("envoy.lb", {"x-gateway-destination-endpoint-served": served})
    values = [HeaderValue(key=":status", raw_value=b"200")]
    headers = HttpHeaders(headers=HeaderMap(headers=values), end_of_stream=end)
    return ProcessingRequest(response_headers=headers, metadata_context=metadata)


class Epp:
    def __init__(self, gateway: Gateway, picker: Picker, channel: Any) -> None:
        self.gateway = gateway
        self.picker = picker
        self.stub = ExternalProcessorStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)

    async def exchange(self, messages: Sequence[ProcessingRequest]) -> list[ProcessingResponse]:
        """Send `messages`, then close our side; every answer until the server closes."""
        call = self.stub.Process()
        for message in messages:
            await call.write(message)
        await call.done_writing()
        return [answer async for answer in call]

    def in_flight(self, worker: str) -> int:
        return self.gateway.loads.load(worker).in_flight


async def _epp(gateway: Gateway, **picker: Any) -> AsyncIterator[Epp]:
    chosen = Picker(gateway, **picker)
    server = grpc_server(chosen, gateway.config.max_payload_size, EppMetrics(CollectorRegistry()))
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield Epp(gateway, chosen, channel)
    finally:
        await server.stop(None)


@pytest.fixture
async def aggregated() -> AsyncIterator[Epp]:
    hit = LookupResult(block_size=4, blocks=3, pods=[PodHit(B, 0, 3, 12, 3.0)])
    workers = [WorkerSpec(url=u, role="prefill") for u in PREFILLS]
    gateway = await make_gateway(
        Cluster(), config(prefill=workers, decode=[]), lookup=StubLookup(hit)
    )
    async for epp in _epp(gateway, fallbacks=1, shed_in_flight=2):
        yield epp


@pytest.fixture
async def disaggregated() -> AsyncIterator[Epp]:
    hit = LookupResult(block_size=4, blocks=3, pods=[PodHit(A, 0, 3, 12, 3.0)])
    gateway = await make_gateway(Cluster(), config(), lookup=StubLookup(hit))
    async for epp in _epp(gateway):
        yield epp


def _body(**fields: Any) -> bytes:
    return json.dumps(
        {"model": "m", "prompt": [1, 2, 3, 4] * 3, "max_tokens": 2, **fields}
    ).encode()


def _routed(answer: ProcessingResponse) -> tuple[str, dict[str, str], str]:
    """(header value, every header set, metadata value) of a request headers answer."""
    common = answer.request_headers.response
    assert common.clear_route_cache
    set_ = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    metadata = answer.dynamic_metadata.fields["envoy.lb"].struct_value
    return (
        set_["x-gateway-destination-endpoint"],
        set_,
        metadata.fields["x-gateway-destination-endpoint"].string_value,
    )


def _streamed(answers: Sequence[ProcessingResponse]) -> tuple[bytes, list[bool]]:
    pieces = [a.request_body.response.body_mutation.streamed_response for a in answers]
    return b"".join(p.body for p in pieces), [p.end_of_stream for p in pieces]


async def test_the_holder_of_the_prefix_is_named_in_the_header_and_the_metadata(
    aggregated: Epp,
) -> None:
    answers = await aggregated.exchange(_request(_body()))
    header, _, metadata = _routed(answers[0])
    assert header == metadata == f"{B},{A}"  # the hit first, the fallback after
    body, ends = _streamed(answers[1:])
    assert body == _body()
    assert ends == [True]


async def test_a_body_in_many_pieces_is_routed_once_whole_and_streamed_back_in_pieces_envoy_takes(
    aggregated: Epp,
) -> None:
    large = _body(padding="x" * 150_000)
    answers = await aggregated.exchange(_request(large, pieces=5))
    assert answers[0].HasField("request_headers")
    body, ends = _streamed(answers[1:])
    assert body == large
    assert ends == [False, False, True]
    assert all(
        len(a.request_body.response.body_mutation.streamed_response.body) <= BODY_PIECE_BYTES
        for a in answers[1:]
    )


async def test_the_load_is_held_until_the_response_ends_and_moves_to_the_endpoint_that_served(
    aggregated: Epp,
) -> None:
    call = aggregated.stub.Process()
    for message in _request(_body()):
        await call.write(message)
    for _ in range(2):
        await call.read()
    assert aggregated.in_flight(B) == 1
    await call.write(_response(served=A))  # Envoy used the fallback
    await call.read()
    assert (aggregated.in_flight(A), aggregated.in_flight(B)) == (1, 0)
    await call.write(ProcessingRequest(response_body=HttpBody(body=b"done", end_of_stream=True)))
    answer = await call.read()
    assert answer.response_body.response.body_mutation.streamed_response.body == b"done"
    assert aggregated.in_flight(A) == 0
    await call.done_writing()


async def test_a_stream_that_closes_early_releases_its_load(aggregated: Epp) -> None:
    await aggregated.exchange(_request(_body()))
    assert aggregated.in_flight(A) == aggregated.in_flight(B) == 0


async def test_pd_routes_to_the_decode_and_names_the_prefill_holding_the_prefix(
    disaggregated: Epp,
) -> None:
    answers = await disaggregated.exchange(_request(_body()))
    header, headers, _ = _routed(answers[0])
    assert header in (D0, D1)
    assert headers["x-globalkv-prefill"] == headers["x-prefiller-host-port"] == A


async def test_the_subset_hint_restricts_the_choice(aggregated: Epp, disaggregated: Epp) -> None:
    answers = await aggregated.exchange(_request(_body(), subset=[A]))
    assert _routed(answers[0])[0] == A
    answers = await disaggregated.exchange(_request(_body(), subset=[D1]))
    assert _routed(answers[0])[0] == D1


@pytest.mark.parametrize("subset", [[], ["10.9.9.9:1"]])
async def test_nothing_eligible_in_the_subset_is_503(aggregated: Epp, subset: list[str]) -> None:
    answers = await aggregated.exchange(_request(_body(), subset=subset))
    assert answers[0].immediate_response.status.code == 503


async def test_requests_are_shed_with_429_when_every_endpoint_is_full(aggregated: Epp) -> None:
    held = []  # streams left open: their requests stay in flight
    for _ in range(5):  # shed_in_flight=2 on each of two workers
        call = aggregated.stub.Process()
        for message in _request(_body()):
            await call.write(message)
        answer = await call.read()
        held.append(call)
    assert answer.immediate_response.status.code == 429
    assert json.loads(answer.immediate_response.body)["error"]["type"] == "overloaded"
    assert aggregated.in_flight(A) >= 2
    assert aggregated.in_flight(B) >= 2
    for call in held:
        await call.done_writing()


@pytest.mark.parametrize(
    "body", [b"{not json", b"[1, 2]", json.dumps({"model": "m", "max_tokens": 2}).encode()]
)
async def test_a_bad_body_is_the_clients_400(aggregated: Epp, body: bytes) -> None:
    answers = await aggregated.exchange(_request(body))
    immediate = answers[0].immediate_response
    assert immediate.status.code == 400
    assert json.loads(immediate.body)["error"]["type"] == "invalid_request_error"


async def test_a_body_over_the_limit_is_413() -> None:
    workers = [WorkerSpec(url=u, role="prefill") for u in PREFILLS]
    gateway = await make_gateway(
        Cluster(), config(prefill=workers, decode=[], max_payload_size=1000)
    )
    async for epp in _epp(gateway):
        answers = await epp.exchange(_request(b"x" * 3000, pieces=3))
        assert [a.immediate_response.status.code for a in answers] == [413]


@pytest.mark.parametrize(
    "messages",
    [
        [ProcessingRequest(request_body=HttpBody(body=b"{}", end_of_stream=True))],
        [
            ProcessingRequest(request_headers=_headers()),
            ProcessingRequest(request_headers=_headers()),
        ],
        [
            ProcessingRequest(
                request_headers=_headers(),
                metadata_context=_metadata(
                    "envoy.lb.subset_hint", {"x-gateway-destination-endpoint-subset": "1.2.3.4:5"}
                ),
            )
        ],
        [ProcessingRequest()],
    ],
)
async def test_messages_out_of_protocol_abort_that_stream_only(
    aggregated: Epp, messages: list[ProcessingRequest]
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await aggregated.exchange(messages)
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    answers = await aggregated.exchange(_request(_body()))
    assert answers[0].HasField("request_headers")


async def test_a_request_without_a_body_is_routed_on_its_headers(aggregated: Epp) -> None:
    message = ProcessingRequest(request_headers=_headers("/v1/models", end=True))
    answers = await aggregated.exchange([message])
    assert len(answers) == 1
    assert answers[0].HasField("request_headers")


async def test_health_says_live_always_and_ready_while_a_worker_can_take_a_request(
    aggregated: Epp,
) -> None:
    async def status(service: str) -> int:
        answer = await aggregated.health.Check(health_pb2.HealthCheckRequest(service=service))
        return int(answer.status)

    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )
    assert [await status(s) for s in ("", "liveness", "readiness", EXT_PROC_SERVICE)] == [
        serving
    ] * 4
    for worker in aggregated.gateway.pool:
        aggregated.gateway.pool.remove(worker.id)
    assert await status("liveness") == serving
    assert await status("readiness") == not_serving
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await status("elsewhere")
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
