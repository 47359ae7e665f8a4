"""The endpoint picker's ext_proc stream, spoken to as Envoy speaks it, over real gRPC:
what it answers in each body mode, the load it holds, and its health."""

from __future__ import annotations

import json

import grpc
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
)
from grpc_health.v1 import health_pb2

from gateway.epp.protocol import BODY_PIECE_BYTES, Answers, RequestHeaders
from gateway.epp.server import EXT_PROC_SERVICE
from gateway.settings.workers import WorkerSpec
from tests.entry.ext_proc import (
    BUFFERED,
    D0,
    D1,
    DUPLEX,
    A,
    B,
    Epp,
    completion,
    headers,
    metadata,
    request,
    response,
    routed,
    serve_epp,
    status,
    streamed,
)
from tests.gateway.fakes import PREFILLS, Cluster, config, make_gateway

pytestmark = pytest.mark.timeout(30)


async def test_the_holder_of_the_prefix_is_named_in_the_header_and_themetadata(
    aggregated: Epp,
) -> None:
    answers = await aggregated.exchange(request(completion()))
    header, _, metadata = routed(answers[0])
    assert header == metadata == f"{B},{A}"  # the hit first, the fallback after
    body, ends = streamed(answers[1:])
    assert body == completion()
    assert ends == [True]


async def test_a_body_in_many_pieces_is_routed_once_whole_and_streamed_back_in_pieces_envoy_takes(
    aggregated: Epp,
) -> None:
    large = completion(padding="x" * 150_000)
    answers = await aggregated.exchange(request(large, pieces=5))
    assert answers[0].HasField("request_headers")
    body, ends = streamed(answers[1:])
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
    for message in request(completion()):
        await call.write(message)
    for _ in range(2):
        await call.read()
    assert aggregated.in_flight(B) == 1
    await call.write(response(served=A))  # Envoy used the fallback
    await call.read()
    assert (aggregated.in_flight(A), aggregated.in_flight(B)) == (1, 0)
    await call.write(ProcessingRequest(response_body=HttpBody(body=b"done", end_of_stream=True)))
    answer = await call.read()
    assert answer.response_body.response.body_mutation.streamed_response.body == b"done"
    assert aggregated.in_flight(A) == 0
    await call.done_writing()


async def test_a_stream_that_closes_early_releases_its_load(aggregated: Epp) -> None:
    await aggregated.exchange(request(completion()))
    assert aggregated.in_flight(A) == aggregated.in_flight(B) == 0


async def test_pd_routes_to_the_decode_and_names_the_prefill_holding_the_prefix(
    disaggregated: Epp,
) -> None:
    answers = await disaggregated.exchange(request(completion()))
    header, headers, _ = routed(answers[0])
    assert header in (D0, D1)
    assert headers["x-globalkv-prefill"] == headers["x-prefiller-host-port"] == A


async def test_the_subset_hint_restricts_the_choice(aggregated: Epp, disaggregated: Epp) -> None:
    answers = await aggregated.exchange(request(completion(), subset=[A]))
    assert routed(answers[0])[0] == A
    answers = await disaggregated.exchange(request(completion(), subset=[D1]))
    assert routed(answers[0])[0] == D1


@pytest.mark.parametrize("subset", [[], ["10.9.9.9:1"]])
async def test_nothing_eligible_in_the_subset_is_503(aggregated: Epp, subset: list[str]) -> None:
    answers = await aggregated.exchange(request(completion(), subset=subset))
    assert answers[0].immediate_response.status.code == 503


async def test_requests_are_shed_with_429_when_every_endpoint_is_full(aggregated: Epp) -> None:
    held = []  # streams left open: their requests stay in flight
    for _ in range(5):  # shed_in_flight=2 on each of two workers
        call = aggregated.stub.Process()
        for message in request(completion()):
            await call.write(message)
        answer = await call.read()
        held.append(call)
    assert answer.immediate_response.status.code == 429
    assert json.loads(answer.immediate_response.body)["error"]["type"] == "overloaded"
    assert aggregated.registry.get_sample_value("globalkv_epp_requests_total", {"outcome": "shed"})
    assert aggregated.in_flight(A) >= 2
    assert aggregated.in_flight(B) >= 2
    for call in held:
        await call.done_writing()


@pytest.mark.parametrize(
    "body", [b"{not json", b"[1, 2]", json.dumps({"model": "m", "max_tokens": 2}).encode()]
)
async def test_a_bad_body_is_the_clients_400(aggregated: Epp, body: bytes) -> None:
    answers = await aggregated.exchange(request(body))
    immediate = answers[0].immediate_response
    assert immediate.status.code == 400
    assert json.loads(immediate.body)["error"]["type"] == "invalid_request_error"


async def test_a_body_over_the_limit_is_413() -> None:
    workers = [WorkerSpec(url=u, role="prefill") for u in PREFILLS]
    gateway = await make_gateway(
        Cluster(), config(prefill=workers, decode=[], max_payload_size=1000)
    )
    async for epp in serve_epp(gateway):
        answers = await epp.exchange(request(b"x" * 3000, pieces=3))
        assert [a.immediate_response.status.code for a in answers] == [413]


@pytest.mark.parametrize(
    "messages",
    [
        [ProcessingRequest(request_body=HttpBody(body=b"{}", end_of_stream=True))],
        [
            ProcessingRequest(request_headers=headers()),
            ProcessingRequest(request_headers=headers()),
        ],
        [
            ProcessingRequest(
                request_headers=headers(),
                metadata_context=metadata(
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
    answers = await aggregated.exchange(request(completion()))
    assert answers[0].HasField("request_headers")


async def test_a_request_without_a_body_is_routed_on_itsheaders(aggregated: Epp) -> None:
    message = ProcessingRequest(request_headers=headers("/v1/models", end=True))
    answers = await aggregated.exchange([message])
    assert len(answers) == 1
    assert answers[0].HasField("request_headers")


async def test_health_says_live_always_and_ready_until_the_picker_drains(
    aggregated: Epp,
) -> None:
    async def health(service: str) -> int:
        answer = await aggregated.health.Check(health_pb2.HealthCheckRequest(service=service))
        return int(answer.status)

    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )
    services = ("", "liveness", "readiness", EXT_PROC_SERVICE)
    assert [await health(s) for s in services] == [serving] * 4
    aggregated.picker.draining = True
    assert [await health(s) for s in services] == [serving, serving, not_serving, not_serving]
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await health("elsewhere")
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


async def test_with_no_endpoint_the_picker_stays_ready_and_answers_each_request_503(
    aggregated: Epp,
) -> None:
    for worker in aggregated.gateway.pool:
        aggregated.gateway.pool.remove(worker.id)
    ready = await aggregated.health.Check(health_pb2.HealthCheckRequest(service="readiness"))
    assert ready.status == health_pb2.HealthCheckResponse.SERVING
    for mode in (BUFFERED, DUPLEX):
        answers = await aggregated.exchange(request(completion(), mode=mode))
        assert [status(a) for a in answers[-1:]] == [503]
        error = json.loads(answers[-1].immediate_response.body)["error"]
        assert error["type"] == "no_available_workers"


async def test_buffered_the_headers_are_answered_at_once_and_the_body_answer_carries_the_pick(
    aggregated: Epp,
) -> None:
    call = aggregated.stub.Process()
    headers_message, body_message = request(completion(), mode=BUFFERED)
    await call.write(headers_message)
    first = await call.read()  # Envoy sends the body only after this answer
    assert first.HasField("request_headers")
    assert not first.request_headers.response.HasField("header_mutation")
    await call.write(body_message)
    second = await call.read()
    assert second.HasField("request_body")
    header, _, value = routed(second)
    assert header == value == f"{B},{A}"
    assert not second.request_body.response.HasField("body_mutation")  # the body goes as sent
    assert aggregated.in_flight(B) == 1
    await call.done_writing()  # Envoy ends the stream when the response ends
    assert await call.read() is grpc.aio.EOF
    assert aggregated.in_flight(B) == 0


async def test_buffered_pd_names_the_prefill_in_the_body_answer(disaggregated: Epp) -> None:
    answers = await disaggregated.exchange(request(completion(), mode=BUFFERED))
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body"]
    header, headers_set, _ = routed(answers[1])
    assert header in (D0, D1)
    assert headers_set["x-globalkv-prefill"] == headers_set["x-prefiller-host-port"] == A


async def test_buffered_a_request_without_a_body_is_routed_on_its_headers(
    aggregated: Epp,
) -> None:
    first = ProcessingRequest(request_headers=headers("/v1/models", end=True))
    first.protocol_config.request_body_mode = BUFFERED
    answers = await aggregated.exchange([first])
    assert len(answers) == 1
    assert routed(answers[0])[0]


@pytest.mark.parametrize("mode", ["NONE", "STREAMED", "BUFFERED_PARTIAL", "GRPC"])
async def test_a_body_mode_the_picker_cannot_pick_in_ends_the_stream_at_once(
    aggregated: Epp, mode: str
) -> None:
    from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode

    call = aggregated.stub.Process()
    await call.write(request(completion(), mode=ProcessingMode.BodySendMode.Value(mode))[0])
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call.read()
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    details = refused.value.details() or ""
    assert mode in details
    assert "BUFFERED or FULL_DUPLEX_STREAMED" in details


def test_a_route_answer_is_kept_for_what_it_removes_too() -> None:
    """Answers are serialized once and kept: two picks of one endpoint that remove
    different headers get different answers, not the first one kept."""
    answers = Answers()
    plain = ProcessingResponse.FromString(answers.route(["10.0.0.1:8000"], (), (), in_body=True))
    removing = ProcessingResponse.FromString(
        answers.route(["10.0.0.1:8000"], (), ("x-prefiller-host-port",), in_body=True)
    )
    assert list(plain.request_body.response.header_mutation.remove_headers) == []
    removed = removing.request_body.response.header_mutation.remove_headers
    assert list(removed) == ["x-prefiller-host-port"]


def test_the_request_headers_read_are_the_path_and_those_wanted_by_their_last_value() -> None:
    """`:path` and the wanted headers, a name in any case, a repeated one by its last
    value, a value sent as `value` (older Envoys) as well as `raw_value`; with none wanted
    sent, the path alone, wherever it comes; a wanted name found only in another header's
    value reads nothing more."""
    sent = [
        HeaderValue(key=":method", raw_value=b"POST"),
        HeaderValue(key="X-SMG-Routing-Key", raw_value=b"first"),
        HeaderValue(key=":path", raw_value=b"/v1/completions"),
        HeaderValue(key="x-smg-routing-key", raw_value=b"last"),
        HeaderValue(key="x-dynamo-session-id", value="older"),
        HeaderValue(key="authorization", raw_value=b"Bearer k"),
    ]
    reader = RequestHeaders({"x-smg-routing-key", "x-dynamo-session-id"})
    path, picked = reader.read(HttpHeaders(headers=HeaderMap(headers=sent)))
    assert path == "/v1/completions"
    assert picked == {"x-smg-routing-key": "last", "x-dynamo-session-id": "older"}
    assert reader.read(HttpHeaders()) == (None, {})

    unwanted = [
        HeaderValue(key=":authority", raw_value=b"gw"),
        HeaderValue(key="referer", raw_value=b"http://x/?X-Dynamo-Session-Id=1"),
        HeaderValue(key="x-other", raw_value=b"1"),
        HeaderValue(key=":PATH", raw_value=b"/generate"),
    ]
    read = reader.read(HttpHeaders(headers=HeaderMap(headers=unwanted)))
    assert read == ("/generate", {})
    none_wanted = [h for h in unwanted if h.key != "referer"]
    read = reader.read(HttpHeaders(headers=HeaderMap(headers=none_wanted)))
    assert read == ("/generate", {})
    only = RequestHeaders({"x-smg-routing-key"})
    upper = [
        HeaderValue(key=":path", raw_value=b"/"),
        HeaderValue(key="X-SMG-ROUTING-KEY", value="k"),
    ]
    assert only.read(HttpHeaders(headers=HeaderMap(headers=upper))) == (
        "/",
        {"x-smg-routing-key": "k"},
    )
    assert RequestHeaders(()).read(HttpHeaders(headers=HeaderMap(headers=sent))) == (
        "/v1/completions",
        {},
    )
