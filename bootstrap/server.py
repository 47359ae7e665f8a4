"""The HTTP directory of one Prefill instance, a drop-in for SGLang's CommonKVBootstrapServer.

`create_app` puts `bootstrap.routes`' answers on SGLang's paths and ours (`/v1/directory`
to read or reset the table, `/metrics`, apart from SGLang's so they can never disturb a
peer); `BootstrapServer` serves it inside an engine's own event loop.

SGLang's paths answer every host as SGLang's do: its prefill ranks and decodes send no
credentials. Our reset (`DELETE /v1/directory`) is in protected mode (`kvplumbing.auth`):
the admin token when one is set, else loopback clients only, unless `insecure`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, ConfigDict, Field

from bootstrap.protocol import DEFAULT_COMPAT, CompatVersion
from bootstrap.routes import BadInput, DirectoryRoutes
from bootstrap.table import Directory, RoomTable
from kvplumbing.auth import ProtectedMode, ProtectionFlags
from kvplumbing.clock import Clock

log = logging.getLogger(__name__)

STANDALONE_FLAGS = ProtectionFlags("bootstrap")
"""`globalkv bootstrap --admin-token / --insecure`."""


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
    admin_token: str | None = Field(
        None,
        min_length=1,
        repr=False,
        description="Required as `Authorization: Bearer …` to reset the directory; without "
        "one, only loopback clients may.",
    )
    insecure: bool = Field(
        False, description="Without an admin token, let any host reset the directory."
    )

    def protected_mode(self, flags: ProtectionFlags = STANDALONE_FLAGS) -> ProtectedMode:
        """`flags`: where the embedding command takes the two settings."""
        return ProtectedMode("the bootstrap directory", self.admin_token, self.insecure, flags)


def create_app(
    config: BootstrapConfig,
    *,
    clock: Clock = time.monotonic,
    registry: CollectorRegistry | None = None,
    flags: ProtectionFlags = STANDALONE_FLAGS,
) -> FastAPI:
    """A directory app; `clock` times registrations and room TTLs, `registry` holds metrics,
    `flags` are what a refused reset names (an engine embedding the directory has its own)."""
    routes = DirectoryRoutes(
        Directory(clock),
        RoomTable(config.room_ttl, config.max_rooms, clock),
        sglang_compat=config.sglang_compat,
        clock=clock,
        registry=CollectorRegistry() if registry is None else registry,
        protected=config.protected_mode(flags),
    )
    app = FastAPI(
        title="globalkv bootstrap directory", docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.config = config
    app.state.directory = routes.directory
    app.state.rooms = routes.rooms
    app.state.registry = routes.registry
    app.exception_handler(BadInput)(routes.bad_input)
    route = app.add_api_route
    route("/health", routes.health, methods=["GET", "HEAD"])
    route("/route", routes.register_rank, methods=["PUT"])
    route("/route", routes.lookup, methods=["GET"])
    route(
        "/route", routes.route_other_method, methods=["POST", "DELETE", "PATCH", "OPTIONS", "HEAD"]
    )
    route("/register_dp_rank", routes.register_dp_rank, methods=["POST"])
    route("/query_dp_ranks", routes.query_dp_ranks, methods=["POST"])
    route("/v1/directory", routes.whole_directory, methods=["GET"])
    route("/v1/directory", routes.reset_directory, methods=["DELETE"])
    route("/metrics", routes.prometheus, methods=["GET"])
    route("/version", routes.version, methods=["GET"])
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
        flags: ProtectionFlags = STANDALONE_FLAGS,
    ) -> None:
        self.config = config
        self.app = create_app(config, clock=clock, registry=registry, flags=flags)
        for warning in config.protected_mode(flags).warnings():
            log.warning("%s", warning)
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
