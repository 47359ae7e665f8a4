"""The least an ext_proc server can do for Envoy per request, as a yardstick for the picker.

    python -m bench.epp_minimal [--transport grpc-aio|h2] PORT IP:PORT [IP:PORT …]

The same messages as `globalkv epp`, answered the same way (bytes serialized ahead) with
no picking: the body is not parsed, the endpoint is the next of those given in turn. It
answers whatever body mode Envoy names (BUFFERED: the headers at once and the pick in the
body's answer; FULL_DUPLEX_STREAMED: the pick in the headers' answer at the body's end and
every piece streamed back) and every response phase Envoy sends, so `bench.epp` can
compare the picker with it in each mode, message for message. Two transports, one way of
answering: `grpc-aio` (grpc.aio on uvloop, `context.read()`/`context.write()`: what a
Python ext_proc server is commonly written on) and `h2` (the picker's own,
`gateway.epp.grpc_h2`: the picker's pick alone, transport for transport). A measuring
instrument: no validation, no limits, no health but SERVING.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
from collections.abc import Sequence
from typing import Any

import grpc
import uvloop
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest
from grpc_health.v1 import health_pb2

from gateway.epp.grpc_calls import Call
from gateway.epp.grpc_h2 import GrpcServer
from gateway.epp.protocol import Answers, body_pieces

_EXT_PROC = "envoy.service.ext_proc.v3.ExternalProcessor"
_HEALTH = "grpc.health.v1.Health"
TRANSPORTS = ("grpc-aio", "h2")
_SERVING = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


class Minimal:
    """The answers to one stream's messages, whatever carries them."""

    def __init__(self, endpoints: Sequence[str]) -> None:
        self._answers = Answers()
        self._next = itertools.cycle([(e,) for e in endpoints])

    def _route(self, in_body: bool) -> bytes:
        return self._answers.route(next(self._next), (), (), in_body=in_body)

    def answer(self, stream: _Stream, message: ProcessingRequest) -> list[bytes]:
        answers = self._answers
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            config = message.protocol_config
            stream.buffered = config.request_body_mode == ProcessingMode.BUFFERED
            stream.duplex = config.response_body_mode == ProcessingMode.FULL_DUPLEX_STREAMED
            if message.request_headers.end_of_stream:
                return [self._route(False)]
            return [answers.request_headers] if stream.buffered else []
        if kind == "request_body":
            if stream.buffered:
                return [self._route(True)]
            stream.body += message.request_body.body
            if not message.request_body.end_of_stream:
                return []
            return [self._route(False), *body_pieces(bytes(stream.body), request=True, end=True)]
        if kind == "request_trailers":
            return [answers.request_trailers]
        if kind == "response_headers":
            return [answers.response_headers]
        if kind == "response_body":
            chunk = message.response_body
            if stream.duplex:
                return list(body_pieces(chunk.body, request=False, end=chunk.end_of_stream))
            return [answers.response_body]
        if kind == "response_trailers":
            return [answers.response_trailers]
        return []


class _Stream:
    __slots__ = ("body", "buffered", "duplex")

    def __init__(self) -> None:
        self.buffered = False
        self.duplex = True
        self.body = bytearray()


async def _serve_grpc_aio(port: int, minimal: Minimal) -> None:
    async def process(_requests: Any, context: Any) -> None:
        stream = _Stream()
        while True:
            message = await context.read()
            if message is grpc.aio.EOF:
                return
            for answer in minimal.answer(stream, message):
                await context.write(answer)

    async def check(_request: Any, _context: Any) -> Any:
        return _SERVING

    server = grpc.aio.server()
    handlers = {
        "Process": grpc.stream_stream_rpc_method_handler(
            process, request_deserializer=ProcessingRequest.FromString
        )
    }
    check_handler = grpc.unary_unary_rpc_method_handler(
        check,
        request_deserializer=health_pb2.HealthCheckRequest.FromString,
        response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(_EXT_PROC, handlers),
            grpc.method_handlers_generic_handler(_HEALTH, {"Check": check_handler}),
        )
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


class _H2Process:
    __slots__ = ("_call", "_minimal", "_stream")

    def __init__(self, minimal: Minimal, call: Call) -> None:
        self._minimal = minimal
        self._call = call
        self._stream = _Stream()

    def message(self, data: bytes) -> None:
        write = self._call.write
        for answer in self._minimal.answer(self._stream, ProcessingRequest.FromString(data)):
            write(answer)

    def half_closed(self) -> None:
        self._call.finish()

    def cancelled(self) -> None:
        pass

    def overflow(self) -> None:
        pass


class _H2Check(_H2Process):
    __slots__ = ()

    def message(self, data: bytes) -> None:
        self._call.write(_SERVING.SerializeToString())
        self._call.finish()


class _Unlimited:
    def take(self, size: int) -> bool:
        return True

    def give(self, size: int) -> None:
        pass


async def _serve_h2(port: int, minimal: Minimal) -> None:
    methods = {
        f"/{_EXT_PROC}/Process": lambda call: _H2Process(minimal, call),
        f"/{_HEALTH}/Check": lambda call: _H2Check(minimal, call),
    }
    server = GrpcServer(methods, max_message=64 << 20, room=_Unlimited())
    await server.start("127.0.0.1", port)
    await asyncio.Event().wait()


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.epp_minimal", description=__doc__)
    parser.add_argument("--transport", choices=TRANSPORTS, default="grpc-aio")
    parser.add_argument("port", type=int)
    parser.add_argument("endpoints", nargs="+", metavar="IP:PORT")
    args = parser.parse_args(argv)
    serve = _serve_h2 if args.transport == "h2" else _serve_grpc_aio
    uvloop.run(serve(args.port, Minimal(args.endpoints)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
