"""The least an ext_proc server can do for Envoy per request, as a yardstick for the picker.

    python -m bench.epp_minimal PORT IP:PORT [IP:PORT …]

The same messages as `globalkv epp`, answered the same way (grpc.aio on uvloop, bytes
serialized ahead, `context.read()`/`context.write()`) with no picking: the body is not
parsed, the endpoint is the next of those given in turn. It answers whatever body mode
Envoy names (BUFFERED: the headers at once and the pick in the body's answer;
FULL_DUPLEX_STREAMED: the pick in the headers' answer at the body's end and every piece
streamed back) and every response phase Envoy sends, so `bench.epp` can compare the
picker with it in each mode, message for message. A measuring instrument: no
validation, no limits, no health but SERVING.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence
from typing import Any

import grpc
import uvloop
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest
from grpc_health.v1 import health_pb2

from gateway.epp.protocol import Answers, body_pieces

_EXT_PROC = "envoy.service.ext_proc.v3.ExternalProcessor"
_HEALTH = "grpc.health.v1.Health"


class Minimal:
    def __init__(self, endpoints: Sequence[str]) -> None:
        self._answers = Answers()
        self._next = itertools.cycle([(e,) for e in endpoints])

    def _route(self, in_body: bool) -> bytes:
        return self._answers.route(next(self._next), (), (), in_body=in_body)

    async def process(self, _requests: Any, context: Any) -> None:
        answers, buffered, duplex_response, body = self._answers, False, True, bytearray()
        while True:
            message = await context.read()
            if message is grpc.aio.EOF:
                return
            kind = message.WhichOneof("request")
            if kind == "request_headers":
                config = message.protocol_config
                buffered = config.request_body_mode == ProcessingMode.BUFFERED
                duplex_response = config.response_body_mode == ProcessingMode.FULL_DUPLEX_STREAMED
                if message.request_headers.end_of_stream:
                    await context.write(self._route(False))
                elif buffered:
                    await context.write(answers.request_headers)
            elif kind == "request_body":
                if buffered:
                    await context.write(self._route(True))
                    continue
                body += message.request_body.body
                if message.request_body.end_of_stream:
                    await context.write(self._route(False))
                    for piece in body_pieces(bytes(body), request=True, end=True):
                        await context.write(piece)
            elif kind == "request_trailers":
                await context.write(answers.request_trailers)
            elif kind == "response_headers":
                await context.write(answers.response_headers)
            elif kind == "response_body":
                chunk = message.response_body
                if duplex_response:
                    for piece in body_pieces(chunk.body, request=False, end=chunk.end_of_stream):
                        await context.write(piece)
                else:
                    await context.write(answers.response_body)
            elif kind == "response_trailers":
                await context.write(answers.response_trailers)


async def _check(_request: Any, _context: Any) -> Any:
    return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


async def _serve(port: int, endpoints: Sequence[str]) -> None:
    server = grpc.aio.server()
    process = grpc.stream_stream_rpc_method_handler(
        Minimal(endpoints).process, request_deserializer=ProcessingRequest.FromString
    )
    check = grpc.unary_unary_rpc_method_handler(
        _check,
        request_deserializer=health_pb2.HealthCheckRequest.FromString,
        response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(_EXT_PROC, {"Process": process}),
            grpc.method_handlers_generic_handler(_HEALTH, {"Check": check}),
        )
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def main(argv: Sequence[str]) -> int:
    uvloop.run(_serve(int(argv[0]), argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
