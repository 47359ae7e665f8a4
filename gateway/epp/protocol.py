"""The Endpoint Picker protocol's words on Envoy's ext_proc messages, read and written.

The Gateway API Inference Extension's protocol (its proposal 004, "Endpoint Picker
Protocol") over `envoy.service.ext_proc.v3`:

- the data plane MAY restrict the pick to a subset: filter metadata
  `envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset`, a list of `ip:port`;
- the picker names the endpoint in the `x-gateway-destination-endpoint` request header
  AND, with the same value, in dynamic metadata `envoy.lb` /
  `x-gateway-destination-endpoint`: `ip:port`, or an ordered list `ip:port,ip:port,…`
  the proxy tries in turn;
- nothing eligible is an ImmediateResponse 503, a request shed one 429 (every refusal
  with the body and head lines the gateway answers the same refusal with);
- on the response the data plane reports the endpoint that served it in the metadata
  context, `envoy.lb` / `x-gateway-destination-endpoint-served`.

A request held in a queue before its pick makes the picker answer late: it then asks the
data plane for more time (`Answers.more_time`).

Answers are written as bytes: those that never change are serialized once (`Answers`),
and a route's answer once per endpoint and prefill named, so a pick costs a dictionary
lookup instead of building and serializing a message with a `Struct` in it.

A body streamed back in FULL_DUPLEX_STREAMED mode goes in pieces of at most
`BODY_PIECE_BYTES`: Envoy takes no larger streamed body message from an ext_proc server.
Everything read here comes from outside, so a value of the wrong shape is refused with a
`ProtocolError` naming it, never trusted.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence

from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption, Metadata
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyMutation,
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    HttpHeaders,
    ImmediateResponse,
    ProcessingResponse,
    StreamedBodyResponse,
    TrailersResponse,
)
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.duration_pb2 import Duration
from google.protobuf.struct_pb2 import Struct, Value

from gateway.http.answer import Answer

DESTINATION = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE = "envoy.lb"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
BODY_PIECE_BYTES = 62_000
_OVERWRITE = HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD
_ROUTES_KEPT = 4096
"""Route answers kept serialized: one per (phase, endpoints, prefill) a pool can name."""
Headers = tuple[tuple[str, str], ...]
"""Request headers an answer sets, as pairs (hashable: answers are kept by them)."""


class ProtocolError(ValueError):
    """A message from the data plane that the protocol does not allow; the text says why."""


class RequestHeaders:
    """Reads a request's `:path` and its headers named in `wanted` (names in lowercase,
    matched in any case; a repeated header keeps its last value).

    Envoy sends about ten headers a request and the picker wants two to four of them,
    usually sent by none: reading each header through protobuf's objects cost more than
    everything else a stream does beside the minimal server (35,000 of 73,000 instructions,
    counted in-process under callgrind). So the header map is first looked at as the bytes
    it was sent in (written back in C, lowercased): when no wanted name occurs there, only
    the headers up to `:path` are read (Envoy sends the pseudo-headers first). A name that
    occurs elsewhere (in a value) only costs the full read."""

    __slots__ = ("_names", "wanted")

    def __init__(self, wanted: Collection[str]) -> None:
        self.wanted = frozenset(wanted)
        self._names = tuple(name.encode("latin-1") for name in self.wanted)

    def read(self, message: HttpHeaders) -> tuple[str | None, dict[str, str]]:
        """The request's `:path` (None when it sent none) and its wanted headers."""
        header_map = message.headers
        if self._names:
            written = header_map.SerializeToString().lower()
            for name in self._names:
                if written.find(name) >= 0:
                    return self._every(header_map.headers)
        for header in header_map.headers:
            if header.key.lower() == ":path":
                return _value(header), {}
        return None, {}

    def _every(self, headers: Iterable[HeaderValue]) -> tuple[str | None, dict[str, str]]:
        """`read` in one pass over every header."""
        wanted = self.wanted
        path: str | None = None
        picked: dict[str, str] = {}
        for header in headers:
            key = header.key.lower()
            if key == ":path":
                path = _value(header)
            elif key in wanted:
                picked[key] = _value(header)
        return path, picked


def _value(header: HeaderValue) -> str:
    """Envoy sends each value as `raw_value` (older Envoys, `value`)."""
    value: str = header.raw_value.decode("latin-1") if header.raw_value else header.value
    return value


def header_of(message: HttpHeaders, name: str) -> str | None:
    """One header's value (`name` in lowercase), without reading the others."""
    for header in message.headers.headers:
        if header.key == name:
            return _value(header)
    return None


def _field(metadata: Metadata, namespace: str, key: str) -> Value | None:
    if namespace not in metadata.filter_metadata:
        return None
    fields = metadata.filter_metadata[namespace].fields
    value: Value | None = fields.get(key)
    return value


def subset_of(metadata: Metadata) -> frozenset[str] | None:
    """The endpoints the data plane allows, or None when it restricts nothing."""
    value = _field(metadata, SUBSET_NAMESPACE, SUBSET)
    if value is None:
        return None
    if value.WhichOneof("kind") != "list_value":
        raise ProtocolError(f"{SUBSET_NAMESPACE}/{SUBSET} must be a list of ip:port")
    endpoints = []
    for item in value.list_value.values:
        if item.WhichOneof("kind") != "string_value":
            raise ProtocolError(f"{SUBSET_NAMESPACE}/{SUBSET} must be a list of ip:port")
        endpoints.append(item.string_value)
    return frozenset(endpoints)


def served_of(metadata: Metadata) -> str | None:
    """The endpoint that served the response, when the data plane reports one."""
    value = _field(metadata, DESTINATION_NAMESPACE, SERVED)
    if value is None:
        return None
    if value.WhichOneof("kind") != "string_value":
        raise ProtocolError(f"{DESTINATION_NAMESPACE}/{SERVED} must be a string ip:port")
    return value.string_value


def _set(name: str, value: str) -> HeaderValueOption:
    header = HeaderValue(key=name, raw_value=value.encode("latin-1"))
    return HeaderValueOption(header=header, append_action=_OVERWRITE)


def _route(
    in_body: bool, value: str, headers: Sequence[tuple[str, str]], removed: Sequence[str]
) -> ProcessingResponse:
    mutation = HeaderMutation(
        set_headers=[_set(DESTINATION, value), *(_set(k, v) for k, v in headers)],
        remove_headers=list(removed),
    )
    metadata = Struct()
    metadata.update({DESTINATION_NAMESPACE: {DESTINATION: value}})
    # The route is chosen again with the header set: a route keyed by it (Envoy's
    # ORIGINAL_DST cluster) may differ from the one the request matched without it.
    common = CommonResponse(header_mutation=mutation, clear_route_cache=True)
    if in_body:
        return ProcessingResponse(
            request_body=BodyResponse(response=common), dynamic_metadata=metadata
        )
    return ProcessingResponse(
        request_headers=HeadersResponse(response=common), dynamic_metadata=metadata
    )


def refuse(answer: Answer, details: str) -> bytes:
    """An ImmediateResponse: the client gets the gateway's own refusal, `answer` (its
    status, body and head lines), as the gateway would send it; `details` is what Envoy
    logs as the response code details."""
    mutation = HeaderMutation(
        set_headers=[
            _set("content-type", answer.media_type.decode("latin-1")),
            *(_set(k, v) for k, v in answer.headers),
        ]
    )
    immediate = ImmediateResponse(
        status=HttpStatus(code=answer.status),
        headers=mutation,
        body=answer.body,
        details=details,
    )
    refused: bytes = ProcessingResponse(immediate_response=immediate).SerializeToString()
    return refused


def body_pieces(body: bytes, *, request: bool, end: bool) -> Iterator[bytes]:
    """`body` streamed back (FULL_DUPLEX_STREAMED) in pieces Envoy takes; `end`: it ends
    the stream's body. An empty body that ends is one empty piece."""
    size = len(body)
    starts = range(0, size, BODY_PIECE_BYTES) if size else range(1)
    for start in starts:
        piece = body[start : start + BODY_PIECE_BYTES]
        last = start + BODY_PIECE_BYTES >= size
        streamed = StreamedBodyResponse(body=piece, end_of_stream=end and last)
        common = CommonResponse(body_mutation=BodyMutation(streamed_response=streamed))
        if request:
            answer = ProcessingResponse(request_body=BodyResponse(response=common))
        else:
            answer = ProcessingResponse(response_body=BodyResponse(response=common))
        yield answer.SerializeToString()


class Answers:
    """Every answer the picker writes, as bytes: the unchanging ones serialized once, the
    routes kept once made (at most `_ROUTES_KEPT`, all dropped past that)."""

    def __init__(self) -> None:
        self.request_headers = ProcessingResponse(
            request_headers=HeadersResponse()
        ).SerializeToString()
        self.request_body = ProcessingResponse(request_body=BodyResponse()).SerializeToString()
        self.response_headers = ProcessingResponse(
            response_headers=HeadersResponse()
        ).SerializeToString()
        self.response_body = ProcessingResponse(response_body=BodyResponse()).SerializeToString()
        self.request_trailers = ProcessingResponse(
            request_trailers=TrailersResponse()
        ).SerializeToString()
        self.response_trailers = ProcessingResponse(
            response_trailers=TrailersResponse()
        ).SerializeToString()
        self._routes: dict[tuple[bool, str, Headers, tuple[str, ...]], bytes] = {}
        self._more_time: dict[float, bytes] = {}

    def route(
        self, endpoints: Sequence[str], headers: Headers, removed: Sequence[str], *, in_body: bool
    ) -> bytes:
        """The pick's answer: `endpoints` (best first) in the header and the metadata, the
        same value in both, with `headers` set and `removed` removed; the request headers'
        answer, or with `in_body` the buffered body's (Envoy applies its header mutation
        to the request headers it still holds)."""
        value = ",".join(endpoints)
        key = (in_body, value, headers, tuple(removed))
        answer = self._routes.get(key)
        if answer is None:
            answer = _route(in_body, value, headers, removed).SerializeToString()
            if len(self._routes) >= _ROUTES_KEPT:
                self._routes.clear()
            self._routes[key] = answer
        return answer

    def more_time(self, secs: float) -> bytes:
        """An answer to no message: the data plane is to wait `secs` for the answer to the
        message it sent last (ext_proc's `override_message_timeout`; Envoy takes one per
        message, of at most its `max_message_timeout`, and only while its timer runs)."""
        answer = self._more_time.get(secs)
        if answer is None:
            timeout = Duration()
            timeout.FromNanoseconds(round(secs * 1e9))
            answer = ProcessingResponse(override_message_timeout=timeout).SerializeToString()
            self._more_time[secs] = answer
        return answer
