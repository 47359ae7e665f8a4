"""`globalkv epp`: an Endpoint Picker for Envoy's ext_proc filter, choosing as the gateway does.

    globalkv epp --grpc-port 9002 --worker http://10.0.0.1:8000 --worker http://10.0.0.2:8000 \\
        --redis-url redis://redis:6379/0 --block-size 16
    globalkv epp --grpc-port 9002 --prefill http://10.0.0.1:30000 8998 \\
        --decode http://10.0.0.3:8000 --redis-url redis://redis:6379/0 --block-size 16

It takes the gateway's flags (workers, policies, index, shared state, breakers, health
checks) plus its own: `--worker URL` for an aggregated pool (whole requests, routed by
the prefill policy), or `--prefill`/`--decode` for PD, where each decode URL is the
address of that decode's `globalkv sidecar`. Besides the gRPC port it serves the
gateway's HTTP routes on `--port` (health, `/metrics`, and `/workers`, through which a
discovery source adds and removes workers).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.http.answer import Answer, problem
from gateway.http.exchange import RelayWire
from gateway.http.server import HttpServer
from gateway.http.wire import HttpRequest
from gateway.serving.launch import (
    CannotListen,
    add_command,
    launch,
    listen,
    running_gateway,
    tune_garbage_collection,
    until_signalled,
)
from gateway.settings.checks import check_gateway
from gateway.settings.config import GatewayConfig
from gateway.settings.flags import add_flags, build_config
from gateway.settings.workers import WorkerSpec
from globalkv.extras import require
from globalkv.tokenize import Tokenizer
from kvplumbing.validation import validation_message

_SHUTDOWN_GRACE_SECS = 5.0


class EppConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    grpc_host: str = Field("0.0.0.0", description="Address the ext_proc gRPC server listens on.")
    grpc_port: int = Field(9002, ge=1, le=65535, description="Port of the ext_proc gRPC server.")
    fallback_endpoints: int = Field(
        0,
        ge=0,
        le=8,
        description="Fallback endpoints named after the chosen one, least loaded first, for "
        "a data plane that tries them in turn (Envoy's ORIGINAL_DST cluster takes one).",
    )
    drain_secs: float = Field(
        3.0,
        ge=0,
        le=60,
        description="On SIGTERM, answer NOT_SERVING to health checks this long, still picking, "
        "so the data plane stops opening streams here before the server stops.",
    )
    shed_in_flight: int | None = Field(
        None,
        ge=1,
        description="Choose only among endpoints with fewer requests in flight than this, "
        "and answer 429 when none has fewer; unset: never shed.",
    )
    max_buffered_bytes: int = Field(
        256 * 1024 * 1024,
        ge=1,
        description="Request body bytes all streams together may hold while their bodies "
        "arrive; a body that would pass it is answered 503 (one body over "
        "--max-payload-size: 413).",
    )
    body_timeout_secs: float = Field(
        60.0,
        gt=0,
        description="Longest a stream may take from its request's headers to the end of its "
        "body; past it the request is answered 408 and what it sent is dropped.",
    )
    pick_timeout_secs: float = Field(
        600.0,
        gt=0,
        description="Longest a pick's load counts in flight: past it the load is released "
        "and the stream ended (the data plane carries on with the request), so streams "
        "nobody closes cannot pin endpoints as full.",
    )


def _add_flags(parser: argparse.ArgumentParser) -> None:
    add_flags(parser)
    group = parser.add_argument_group("endpoint picker")
    group.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="URL",
        help="an aggregated worker (whole requests); repeatable, instead of --prefill/--decode",
    )
    fields = EppConfig.model_fields
    for name, kind in (
        ("grpc_host", str),
        ("grpc_port", int),
        ("fallback_endpoints", int),
        ("shed_in_flight", int),
        ("drain_secs", float),
        ("max_buffered_bytes", int),
        ("body_timeout_secs", float),
        ("pick_timeout_secs", float),
    ):
        info = fields[name]
        group.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            type=kind,
            default=info.default,
            metavar=name.upper(),
            help=f"{info.description} (default: {info.default})",
        )


def build_configs(args: argparse.Namespace) -> tuple[GatewayConfig, EppConfig]:
    """The gateway's configuration (workers included) and the picker's; `ValueError` with
    the reason when the flags are wrong."""
    config = build_config(args)
    if args.worker and (config.prefill or config.decode):
        raise ValueError("--worker (aggregated) and --prefill/--decode (PD) do not mix")
    if not args.worker and config.decode and not config.prefill:
        raise ValueError("PD needs --prefill workers as well as --decode (sidecar) workers")
    try:
        if args.worker:
            workers = [WorkerSpec(url=url, role="prefill").model_dump() for url in args.worker]
            config = GatewayConfig.model_validate({**config.model_dump(), "prefill": workers})
        epp = EppConfig(
            grpc_host=args.grpc_host,
            grpc_port=args.grpc_port,
            fallback_endpoints=args.fallback_endpoints,
            shed_in_flight=args.shed_in_flight,
            drain_secs=args.drain_secs,
            max_buffered_bytes=args.max_buffered_bytes,
            body_timeout_secs=args.body_timeout_secs,
            pick_timeout_secs=args.pick_timeout_secs,
        )
    except ValidationError as exc:
        raise ValueError(validation_message(exc)) from None
    return config, epp


class _NoInference:
    """The HTTP server's handler: the picker answers no inference itself."""

    paths: tuple[str, ...] = ()
    limit = 0

    async def handle(
        self, path: str, authorization: str | None, body: bytes, headers: Any = ()
    ) -> Answer:
        return problem(404, f"{path}: send inference through Envoy")

    def refused(self, path: str, answer: Answer) -> None:
        return None

    def begin(self, request: HttpRequest, wire: RelayWire) -> None:
        return None  # it has no paths


async def serve(config: GatewayConfig, epp: EppConfig, tokenizer: Tokenizer | None) -> None:
    from gateway.epp.picker import Picker
    from gateway.epp.server import grpc_server
    from gateway.epp.stream import EppMetrics, StreamLimits

    async with running_gateway(config, tokenizer) as (gateway, app):
        picker = Picker(
            gateway, fallbacks=epp.fallback_endpoints, shed_in_flight=epp.shed_in_flight
        )
        metrics = EppMetrics(gateway.metrics.registry)
        by_payload = config.max_payload_size <= epp.max_buffered_bytes
        limits = StreamLimits(
            body_bytes=min(config.max_payload_size, epp.max_buffered_bytes),
            body_flag="--max-payload-size" if by_payload else "--max-buffered-bytes",
            buffered_bytes=epp.max_buffered_bytes,
            body_secs=epp.body_timeout_secs,
            pick_secs=epp.pick_timeout_secs,
        )
        grpc = grpc_server(picker, limits, metrics)
        where = f"{epp.grpc_host}:{epp.grpc_port} (--grpc-port)"
        try:
            await grpc.start(epp.grpc_host, epp.grpc_port)
        except OSError as exc:
            raise CannotListen(f"epp cannot serve on {where}: {exc}") from exc
        http = HttpServer(_NoInference(), app, max_connections=config.max_client_connections)
        await listen(http, "epp", config)
        tune_garbage_collection()
        try:
            await until_signalled()
            picker.draining = True
            await asyncio.sleep(epp.drain_secs)
        finally:
            await asyncio.gather(
                grpc.stop(_SHUTDOWN_GRACE_SECS), http.shutdown(grace=_SHUTDOWN_GRACE_SECS)
            )


def check_config(args: argparse.Namespace) -> list[str]:
    config, epp = build_configs(args)
    require("globalkv epp", "epp", "h2", "grpc_health", "envoy.service.ext_proc")
    shape = "aggregated workers" if args.worker else "PD, each decode at its sidecar"
    picker = f"endpoint picker: ext_proc on {epp.grpc_host}:{epp.grpc_port}, {shape}"
    return [picker, *check_gateway(config, load_tokenizer=args.check)]


def run(args: argparse.Namespace) -> int:
    config, epp = build_configs(args)

    async def serving(config: GatewayConfig, tokenizer: Tokenizer | None) -> None:
        await serve(config, epp, tokenizer)

    return launch(args, config, "epp", serving)


def register(subparsers: Any) -> None:
    summary = "an endpoint picker for Envoy (ext_proc), choosing as the gateway does"
    add_command(subparsers, "epp", summary, __doc__, _add_flags, run, check_config)
