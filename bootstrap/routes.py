"""What each path of a directory answers: SGLang's, rendered as SGLang renders them, and ours.

Answers a real SGLang decode reads have SGLang's status, keys, `json.dumps` bytes and
content types. Where SGLang crashes into a 500 on malformed input, these answer 400/422
naming what is wrong and leave the table as it was.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from bootstrap.metrics import DirectoryMetrics
from bootstrap.protocol import (
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
from kvplumbing.auth import ProtectedMode
from kvplumbing.clock import Clock
from kvplumbing.release import VERSION
from kvplumbing.validation import validation_message

log = logging.getLogger("bootstrap.server")
"""The directory's one logger, whichever module writes: its lines are selected by this name."""

MAX_BODY_BYTES = 4 * 1024 * 1024
"""Largest request body read; a full /query_dp_ranks body is about 1.4 MB."""

_RANK_PARAM = re.compile(r"-?\d{1,9}")
_Body = TypeVar("_Body", bound=BaseModel)


class SGLangJSONResponse(Response):
    """JSON as aiohttp's `json_response` writes it (`json.dumps` defaults), so SGLang's
    peers receive the very bytes SGLang itself would send."""

    media_type = "application/json; charset=utf-8"

    def render(self, content: Any) -> bytes:
        return json.dumps(content).encode()


class BadInput(Exception):
    """A request the directory refuses: `status` and the plain-text `message` to answer."""

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
    """Read, parse and validate a body, or raise `BadInput` with the status to answer."""
    chunks = bytearray()
    try:
        async for chunk in request.stream():
            chunks += chunk
            if len(chunks) > MAX_BODY_BYTES:
                raise BadInput(413, f"{what}: body exceeds {MAX_BODY_BYTES} bytes")
    except ClientDisconnect:
        raise BadInput(400, f"{what}: the client left before sending the whole body") from None
    try:
        data = json.loads(chunks, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:
        raise BadInput(400, f"{what}: body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadInput(422, f"{what}: body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise BadInput(422, f"{what}: {validation_message(exc)}") from None


def _route_coordinate(request: Request) -> Coordinate:
    params = request.query_params
    missing = [name for name in ROUTE_PARAMS if not params.get(name)]
    if missing:
        raise BadInput(
            400, f"Missing inputs for bootstrap server. Missing or empty: {', '.join(missing)}"
        )
    bad = [f"{n}={params[n]!r}" for n in ROUTE_PARAMS if not _RANK_PARAM.fullmatch(params[n])]
    if bad:
        raise BadInput(400, f"rank parameters must be decimal integers: {', '.join(bad)}")
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


class DirectoryRoutes:
    """SGLang's directory paths and ours over one table and its rooms; `server.create_app`
    puts each on its path."""

    def __init__(
        self,
        directory: Directory,
        rooms: RoomTable,
        *,
        sglang_compat: CompatVersion,
        clock: Clock,
        registry: CollectorRegistry,
        protected: ProtectedMode,
    ) -> None:
        self.directory = directory
        self.rooms = rooms
        self.sglang_compat = sglang_compat
        self.clock = clock
        self.registry = registry
        self.protected = protected
        self.metrics = DirectoryMetrics(registry, directory, rooms)

    async def bad_input(self, _: Request, exc: BadInput) -> Response:
        return _text(exc.status, exc.message)

    async def health(self) -> Response:
        return _text(200, READY_TEXT)

    async def version(self) -> dict[str, str]:
        """Ours; SGLang's `/health` answers a bare text its clients check, so it stays so."""
        return {"version": VERSION}

    # ------------------------------------------------------------ SGLang's paths

    async def register_rank(self, request: Request) -> Response:
        """PUT /route: a prefill rank announcing where it listens."""
        registrations = self.metrics.registrations
        try:
            reg = await _json_body(request, "invalid registration", RankRegistration)
        except BadInput:
            registrations.labels("invalid").inc()
            raise
        try:
            outcome = self.directory.register(reg)
        except RegistrationRefused as exc:
            registrations.labels("refused").inc()
            log.warning("refused %s from %s: %s", reg.coordinate, reg.address, exc.message)
            return _text(400, exc.message)
        registrations.labels(outcome.kind).inc()
        _log_registration(outcome)
        return _text(200, READY_TEXT)

    async def lookup(self, request: Request) -> Response:
        """GET /route: the topology snapshot (four -1) or one rank's address."""
        lookups = self.metrics.lookups
        try:
            coord = _route_coordinate(request)
        except BadInput:
            lookups.labels("malformed", "bad_request").inc()
            raise
        kind = "snapshot" if coord == (-1, -1, -1, -1) else "rank"
        directory = self.directory
        topology = directory.topology
        if topology is None or not directory.ready:
            lookups.labels(kind, "not_ready").inc()
            return _text(503, not_ready_text(directory.registered))
        if kind == "snapshot":
            lookups.labels(kind, "ok").inc()
            return SGLangJSONResponse(topology.snapshot(self.sglang_compat))
        address = directory.lookup(coord)
        if address is None:
            lookups.labels(kind, "not_found").inc()
            return _text(404, not_found_text(coord))
        lookups.labels(kind, "ok").inc()
        return SGLangJSONResponse(address.model_dump())

    async def route_other_method(self) -> Response:
        return _text(405, "Method not allowed")

    async def register_dp_rank(self, request: Request) -> Response:
        """POST /register_dp_rank: which DP rank serves a room."""
        room_requests = self.metrics.room_requests
        try:
            entry = await _json_body(request, "invalid /register_dp_rank body", RoomRegistration)
        except BadInput:
            room_requests.labels("register_dp_rank", "invalid").inc()
            raise
        self.rooms.put(entry.bootstrap_room, entry.dp_rank)
        room_requests.labels("register_dp_rank", "ok").inc()
        log.debug("room %d -> dp_rank %d", entry.bootstrap_room, entry.dp_rank)
        return _text(200, READY_TEXT)

    async def query_dp_ranks(self, request: Request) -> Response:
        """POST /query_dp_ranks: the DP ranks of the rooms a decode waits for."""
        metrics = self.metrics
        try:
            query = await _json_body(request, "invalid /query_dp_ranks body", RoomQuery)
        except BadInput:
            metrics.room_requests.labels("query_dp_ranks", "invalid").inc()
            raise
        found = self.rooms.query(query.bootstrap_rooms)
        metrics.room_requests.labels("query_dp_ranks", "ok").inc()
        metrics.rooms_queried.labels("found").inc(len(found))
        metrics.rooms_queried.labels("unknown").inc(len(query.bootstrap_rooms) - len(found))
        return SGLangJSONResponse({str(room): dp for room, dp in found.items()})

    # ------------------------------------------------------------ ours

    async def whole_directory(self) -> Response:
        """Ours, for operators and the control plane. `registered_at` is a reading of the
        directory's clock (monotonic by default): compare ranks by it, or read `age_seconds`."""
        now = self.clock()
        directory = self.directory
        topology = directory.topology
        return JSONResponse(
            {
                "ready": directory.ready,
                "sglang_compat": self.sglang_compat,
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
                "rooms": len(self.rooms),
            }
        )

    async def reset_directory(self, request: Request) -> Response:
        """Ours: empty the table and the rooms, so the next registration fixes a new
        topology. Stop the old ranks first: their keep-alive would register them again.

        Protected, unlike SGLang's paths: whoever reaches the port can PUT a rank, but a
        reset would also drop every rank and room a live instance is serving from."""
        client = request.client.host if request.client is not None else "unknown"
        refusal = self.protected.check_request(request)
        if refusal is not None:
            log.warning("directory reset refused for %s (HTTP %d)", client, refusal.status)
            return _text(refusal.status, refusal.message)
        ranks, room_entries = self.directory.reset(), self.rooms.clear()
        log.warning(
            "directory reset by %s: dropped %d ranks and %d room entries",
            client,
            ranks,
            room_entries,
        )
        return JSONResponse({"dropped_ranks": ranks, "dropped_rooms": room_entries})

    async def prometheus(self) -> Response:
        self.rooms.expire()
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
