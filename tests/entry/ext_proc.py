"""Speaking to the endpoint picker as Envoy does, over real gRPC on a loopback port.

The picker runs on a gateway over fake workers (`tests.gateway.fakes`), so what it chooses
and the load it holds are the gateway's own.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, Metadata
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
    ProtocolConfiguration,
)
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub
from google.protobuf.struct_pb2 import Struct
from grpc_health.v1 import health_pb2_grpc
from prometheus_client import CollectorRegistry

from gateway.epp.picker import Picker
from gateway.epp.server import grpc_server
from gateway.epp.stream import EppMetrics, StreamLimits
from gateway.serving.service import Gateway
from tests.gateway.fakes import DECODES, PREFILLS
from tests.support.net import free_port

A, B = (u.split("//", 1)[1] for u in PREFILLS)
D0, D1 = (u.split("//", 1)[1] for u in DECODES)
BUFFERED = ProcessingMode.BUFFERED
DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED


def headers(path: str = "/v1/completions", *, end: bool = False, **extra: str) -> HttpHeaders:
    pairs = {":method": "POST", ":path": path, "content-type": "application/json", **extra}
    values = [HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    return HttpHeaders(headers=HeaderMap(headers=values), end_of_stream=end)


def metadata(namespace: str, fields: dict[str, Any]) -> Metadata:
    value = Struct()
    value.update(fields)
    out = Metadata()
    out.filter_metadata[namespace].CopyFrom(value)
    return out


def request(
    payload: bytes,
    *,
    pieces: int = 1,
    subset: Sequence[str] | None = None,
    mode: int | None = None,
    path: str = "/v1/completions",
    extra: dict[str, str] | None = None,
) -> list[ProcessingRequest]:
    """The request's messages as Envoy sends them: headers (`extra` among them, with the
    subset hint, and `mode` as the request body mode Envoy names), then the body in
    `pieces`."""
    hint = {} if subset is None else {"x-gateway-destination-endpoint-subset": list(subset)}
    context = metadata("envoy.lb.subset_hint", hint) if subset is not None else Metadata()
    first = ProcessingRequest(
        request_headers=headers(path, **(extra or {})), metadata_context=context
    )
    if mode is not None:
        first.protocol_config.CopyFrom(ProtocolConfiguration(request_body_mode=mode))
    out = [first]
    size = max(1, -(-len(payload) // pieces))
    for start in range(0, len(payload), size):
        last = start + size >= len(payload)
        piece = HttpBody(body=payload[start : start + size], end_of_stream=last)
        out.append(ProcessingRequest(request_body=piece))
    return out


def response(served: str | None = None, *, end: bool = False) -> ProcessingRequest:
    context = Metadata()
    if served is not None:
        context = metadata("envoy.lb", {"x-gateway-destination-endpoint-served": served})
    values = [HeaderValue(key=":status", raw_value=b"200")]
    answer = HttpHeaders(headers=HeaderMap(headers=values), end_of_stream=end)
    return ProcessingRequest(response_headers=answer, metadata_context=context)


class Epp:
    def __init__(
        self, gateway: Gateway, picker: Picker, channel: Any, registry: CollectorRegistry
    ) -> None:
        self.gateway = gateway
        self.picker = picker
        self.registry = registry
        self.stub = ExternalProcessorStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)

    async def exchange(self, messages: Sequence[ProcessingRequest]) -> list[ProcessingResponse]:
        """Send `messages`, then close our side; every answer until the server closes."""
        call = self.stub.Process()
        try:
            for message in messages:
                await call.write(message)
            await call.done_writing()
        except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
            # The picker ended the stream before taking every message (a refusal, an
            # abort): what it answered, and its status, are read below.
            pass
        return [answer async for answer in call]

    def in_flight(self, worker: str) -> int:
        return self.gateway.loads.load(worker).in_flight

    def buffered(self) -> float:
        """The request body bytes the picker holds now, as its metric says."""
        return self.registry.get_sample_value("globalkv_epp_buffered_bytes") or 0.0


def limits(gateway: Gateway, **overrides: Any) -> StreamLimits:
    given: dict[str, Any] = {
        "body_bytes": gateway.config.max_payload_size,
        "body_flag": "--max-payload-size",
        "buffered_bytes": 1 << 30,
        "body_secs": 20.0,
        "pick_secs": 20.0,
        **overrides,
    }
    return StreamLimits(**given)


async def serve_epp(
    gateway: Gateway, stream_limits: StreamLimits | None = None, **picker: Any
) -> AsyncIterator[Epp]:
    chosen = Picker(gateway, **picker)
    given = stream_limits or limits(gateway)
    registry = CollectorRegistry()
    server = grpc_server(chosen, given, EppMetrics(registry))
    port = free_port()
    await server.start("127.0.0.1", port)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield Epp(gateway, chosen, channel, registry)
    finally:
        await server.stop(0)


def status(answer: ProcessingResponse) -> int:
    """The status of an ImmediateResponse (0: the answer is none)."""
    return int(answer.immediate_response.status.code)


def completion(**fields: Any) -> bytes:
    return json.dumps(
        {"model": "m", "prompt": [1, 2, 3, 4] * 3, "max_tokens": 2, **fields}
    ).encode()


def routed(answer: ProcessingResponse) -> tuple[str, dict[str, str], str]:
    """(header value, every header set, metadata value) of the answer carrying the pick:
    the request headers' (FULL_DUPLEX_STREAMED) or the buffered body's (BUFFERED)."""
    phase = "request_body" if answer.HasField("request_body") else "request_headers"
    common = getattr(answer, phase).response
    assert common.clear_route_cache
    set_ = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    value = answer.dynamic_metadata.fields["envoy.lb"].struct_value
    return (
        set_["x-gateway-destination-endpoint"],
        set_,
        value.fields["x-gateway-destination-endpoint"].string_value,
    )


def streamed(answers: Sequence[ProcessingResponse]) -> tuple[bytes, list[bool]]:
    pieces = [a.request_body.response.body_mutation.streamed_response for a in answers]
    return b"".join(p.body for p in pieces), [p.end_of_stream for p in pieces]
