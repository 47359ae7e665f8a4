"""The HTTP directory of one Prefill instance, a drop-in for SGLang's CommonKVBootstrapServer.

Answers a real SGLang decode reads are rendered exactly as SGLang renders them (same
status, same keys, same `json.dumps` bytes, same content types). Where SGLang crashes
into a 500 on malformed input, this server answers 400/422 naming what is wrong and
leaves the table as it was. Our own paths (`/v1/directory` to read or reset the table,
`/metrics`) are apart from SGLang's, so they can never disturb a peer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import time
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect

from bootstrap.metrics import DirectoryMetrics
from bootstrap.protocol import (
    DEFAULT_COMPAT,
    READY_TEXT,
    ROUTE_PARAMS,
    CompatVersion,
    Coordinate,
    RankRegistration,
    RoomQuery,
    RoomRegistration,
    not_found_text,
    not_ready_text,
)
from bootstrap.table import Directory, RegisterOutcome, RegistrationRefused, RoomTable
from kvplumbing.clock import Clock
from kvplumbing.validation import validation_message

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024
"""Largest request body read; a full /query_dp_ranks body is about 1.4 MB."""

_RANK_PARAM = re.compile(r"-?\d{1,9}")
_Body = TypeVar("_Body", bound=BaseModel)


class BootstrapConfig(BaseModel):
    """Settings of one directory (`globalkv bootstrap`, or embedded by an engine)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field("0.0.0.0", min_length=1, description="Address to listen on.")
    port: int = Field(
        8998, ge=0, le=65535, description="Port to listen on (SGLang's default; 0 = any free)."
    )
    sglang_compat: CompatVersion = Field(
        DEFAULT_COMPAT,
        description="SGLang version of the decodes: fixes the topology snapshot's key set.",
    )
    room_ttl: float = Field(
        120.0,
        gt=0,
        allow_inf_nan=False,
        description="Seconds a room -> dp_rank entry is kept (SGLang sweeps every 120 s).",
    )
    max_rooms: int = Field(
        100_000, ge=1, description="Hard cap on room entries; the oldest go first when full."
    )


class SGLangJSONResponse(Response):
    """JSON as aiohttp's `json_response` writes it (`json.dumps` defaults), so SGLang's
    peers receive the very bytes SGLang itself would send."""

    media_type = "application/json; charset=utf-8"

    def render(self, content: Any) -> bytes:
        return json.dumps(content).encode()


class _BadInput(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _text(status: int, message: str) -> PlainTextResponse:
    return PlainTextResponse(message, status_code=status)


def _refuse_constant(name: str) -> object:
    """NaN and Infinity are not JSON: kept in a layout, they would break every later
    JSON answer that shows it (`/v1/directory` renders strictly)."""
    raise ValueError(f"{name} is not a JSON value")


async def _json_body(request: Request, what: str, model: type[_Body]) -> _Body:
    """Read, parse and validate a body, or raise `_BadInput` with the status to answer."""
    chunks = bytearray()
    try:
        async for chunk in request.stream():
            chunks += chunk
            if len(chunks) > MAX_BODY_BYTES:
                raise _BadInput(413, f"{what}: body exceeds {MAX_BODY_BYTES} bytes")
    except ClientDisconnect:
        raise _BadInput(400, f"{what}: the client left before sending the whole body") from None
    try:
        data = json.loads(chunks, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:
        raise _BadInput(400, f"{what}: body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise _BadInput(422, f"{what}: body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _BadInput(422, f"{what}: {validation_message(exc)}") from None


def _route_coordinate(request: Request) -> Coordinate:
    params = request.query_params
    missing = [name for name in ROUTE_PARAMS if not params.get(name)]
    if missing:
        raise _BadInput(
            400, f"Missing inputs for bootstrap server. Missing or empty: {', '.join(missing)}"
        )
    bad = [f"{n}={params[n]!r}" for n in ROUTE_PARAMS if not _RANK_PARAM.fullmatch(params[n])]
    if bad:
        raise _BadInput(400, f"rank parameters must be decimal integers: {', '.join(bad)}")
    return Coordinate(*(int(params[name]) for name in ROUTE_PARAMS))


def _log_registration(outcome: RegisterOutcome) -> None:
    progress = f"({outcome.registered}/{outcome.expected} coordinates)"
    if outcome.kind == "new":
        log.info("registered %s at %s %s", outcome.coordinate, outcome.address, progress)
    elif outcome.kind == "moved":
        log.info(
            "re-registered %s at %s, was %s %s",
            outcome.coordinate,
            outcome.address,
            outcome.previous,
            progress,
        )
    else:
        log.debug("refreshed %s at %s %s", outcome.coordinate, outcome.address, progress)
    if outcome.became_ready:
        log.info("directory ready: all %d coordinates registered", outcome.expected)


def create_app(
    config: BootstrapConfig,
    *,
    clock: Clock = time.monotonic,
    registry: CollectorRegistry | None = None,
) -> FastAPI:
    """A directory app; `clock` times registrations and room TTLs, `registry` holds metrics."""
    directory = Directory(clock)
    rooms = RoomTable(config.room_ttl, config.max_rooms, clock)
    registry = CollectorRegistry() if registry is None else registry
    metrics = DirectoryMetrics(registry, directory, rooms)

    app = FastAPI(
        title="globalkv bootstrap directory", docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.config = config
    app.state.directory = directory
    app.state.rooms = rooms
    app.state.registry = registry

    @app.exception_handler(_BadInput)
    async def bad_input(_: Request, exc: _BadInput) -> Response:
        return _text(exc.status, exc.message)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        return _text(200, READY_TEXT)

    @app.put("/route")
    async def register_rank(request: Request) -> Response:
        try:
            reg = await _json_body(request, "invalid registration", RankRegistration)
        except _BadInput:
            metrics.registrations.labels("invalid").inc()
            raise
        try:
            outcome = directory.register(reg)
        except RegistrationRefused as exc:
            metrics.registrations.labels("refused").inc()
            log.warning("refused %s from %s: %s", reg.coordinate, reg.address, exc.message)
            return _text(400, exc.message)
        metrics.registrations.labels(outcome.kind).inc()
        _log_registration(outcome)
        return _text(200, READY_TEXT)

    @app.get("/route")
    async def lookup(request: Request) -> Response:
        try:
            coord = _route_coordinate(request)
        except _BadInput:
            metrics.lookups.labels("malformed", "bad_request").inc()
            raise
        kind = "snapshot" if coord == (-1, -1, -1, -1) else "rank"
        topology = directory.topology
        if topology is None or not directory.ready:
            metrics.lookups.labels(kind, "not_ready").inc()
            return _text(503, not_ready_text(directory.registered))
        if kind == "snapshot":
            metrics.lookups.labels(kind, "ok").inc()
            return SGLangJSONResponse(topology.snapshot(config.sglang_compat))
        address = directory.lookup(coord)
        if address is None:
            metrics.lookups.labels(kind, "not_found").inc()
            return _text(404, not_found_text(coord))
        metrics.lookups.labels(kind, "ok").inc()
        return SGLangJSONResponse(address.model_dump())

    @app.api_route("/route", methods=["POST", "DELETE", "PATCH", "OPTIONS", "HEAD"])
    async def route_other_method() -> Response:
        return _text(405, "Method not allowed")

    @app.post("/register_dp_rank")
    async def register_dp_rank(request: Request) -> Response:
        try:
            entry = await _json_body(request, "invalid /register_dp_rank body", RoomRegistration)
        except _BadInput:
            metrics.room_requests.labels("register_dp_rank", "invalid").inc()
            raise
        rooms.put(entry.bootstrap_room, entry.dp_rank)
        metrics.room_requests.labels("register_dp_rank", "ok").inc()
        log.debug("room %d -> dp_rank %d", entry.bootstrap_room, entry.dp_rank)
        return _text(200, READY_TEXT)

    @app.post("/query_dp_ranks")
    async def query_dp_ranks(request: Request) -> Response:
        try:
            query = await _json_body(request, "invalid /query_dp_ranks body", RoomQuery)
        except _BadInput:
            metrics.room_requests.labels("query_dp_ranks", "invalid").inc()
            raise
        found = rooms.query(query.bootstrap_rooms)
        metrics.room_requests.labels("query_dp_ranks", "ok").inc()
        metrics.rooms_queried.labels("found").inc(len(found))
        metrics.rooms_queried.labels("unknown").inc(len(query.bootstrap_rooms) - len(found))
        return SGLangJSONResponse({str(room): dp for room, dp in found.items()})

    @app.get("/v1/directory")
    async def whole_directory() -> Response:
        """Ours, for operators and the control plane. `registered_at` is a reading of the
        directory's clock (monotonic by default): compare ranks by it, or read `age_seconds`."""
        now = clock()
        topology = directory.topology
        return JSONResponse(
            {
                "ready": directory.ready,
                "sglang_compat": config.sglang_compat,
                "topology": None if topology is None else topology.model_dump(),
                "expected": directory.expected,
                "registered": directory.registered,
                "missing": [list(c) for c in directory.missing()],
                "ranks": [
                    {
                        **e.coordinate._asdict(),
                        **e.address.model_dump(),
                        "registered_at": e.registered_at,
                        "age_seconds": round(now - e.registered_at, 3),
                    }
                    for e in directory.entries()
                ],
                "registrations_accepted": directory.accepted,
                "rooms": len(rooms),
            }
        )

    @app.delete("/v1/directory")
    async def reset_directory(request: Request) -> Response:
        """Ours: empty the table and the rooms, so the next registration fixes a new
        topology. Stop the old ranks first: their keep-alive would register them again.
        Like every path of SGLang's directory, it asks for no credentials: whoever reaches
        the port can already PUT any rank."""
        ranks, room_entries = directory.reset(), rooms.clear()
        client = request.client.host if request.client is not None else "unknown"
        log.warning(
            "directory reset by %s: dropped %d ranks and %d room entries",
            client,
            ranks,
            room_entries,
        )
        return JSONResponse({"dropped_ranks": ranks, "dropped_rooms": room_entries})

    @app.get("/metrics")
    async def prometheus() -> Response:
        rooms.expire()
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _connect_host(host: str) -> str:
    wildcard = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}
    host = wildcard.get(host, host)
    return f"[{host}]" if ":" in host else host


class BootstrapServer:
    """A directory served by uvicorn inside the caller's running event loop.

    It binds its own socket (so port 0 works and a bind error is an ordinary `OSError`)
    and drives uvicorn's startup, main loop and shutdown itself: `uvicorn.Server.serve`
    would install process signal handlers, which belong to whoever embeds the directory.
    """

    def __init__(
        self,
        config: BootstrapConfig,
        *,
        clock: Clock = time.monotonic,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.config = config
        self.app = create_app(config, clock=clock, registry=registry)
        self.directory: Directory = self.app.state.directory
        """The live table, for an embedding engine that wants readiness without HTTP."""
        self._server: uvicorn.Server | None = None
        self._socket: socket.socket | None = None
        self._main_loop: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("bootstrap server already started")
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        sock = socket.create_server((self.config.host, self.config.port), family=family)
        uv_config = uvicorn.Config(
            self.app,
            http="httptools",
            lifespan="off",
            access_log=False,
            log_config=None,
            timeout_graceful_shutdown=5,
        )
        uv_config.load()
        server = uvicorn.Server(uv_config)
        server.lifespan = uv_config.lifespan_class(uv_config)
        try:
            await server.startup(sockets=[sock])
        except BaseException:
            sock.close()
            raise
        self._socket, self._server = sock, server
        self._main_loop = asyncio.create_task(server.main_loop(), name="bootstrap-uvicorn")
        log.info(
            "bootstrap directory listening on %s:%d (SGLang %s snapshot)",
            self.config.host,
            self.port,
            self.config.sglang_compat,
        )

    @property
    def port(self) -> int:
        if self._socket is None:
            raise RuntimeError("bootstrap server not started")
        return int(self._socket.getsockname()[1])

    @property
    def url(self) -> str:
        """`http://host:port` to reach this directory from the same host."""
        return f"http://{_connect_host(self.config.host)}:{self.port}"

    async def stop(self) -> None:
        server, sock, main_loop = self._server, self._socket, self._main_loop
        if server is None or sock is None or main_loop is None:
            return
        server.should_exit = True
        await main_loop
        await server.shutdown(sockets=[sock])
        self._server = self._socket = self._main_loop = None
