"""The gateway's routes other than inference, as an ASGI app: info, health, metrics, admin.

The gateway's own server (`gateway.http.server`) answers the inference paths (`/generate`,
`/v1/completions`, `/v1/chat/completions`) itself, through `gateway.serving.inference`, and hands
every other request to this app, so those routes are written once, with FastAPI. The
worker admin API lives in `gateway.serving.admin`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.http.answer import Answer, problem
from gateway.serving.admin import admin_routes
from gateway.serving.service import Gateway
from kvplumbing.auth import bearer_ok
from kvplumbing.release import VERSION


def _response(answer: Answer) -> Response:
    return Response(answer.body, answer.status, media_type=answer.media_type.decode("latin-1"))


async def _proxy_get(gateway: Gateway, request: Request, paths: tuple[str, ...]) -> Response:
    """A GET answered by an eligible worker (decodes first), trying each path in turn; a
    worker that cannot be reached hands over to the next (health checks notice it late)."""
    if not bearer_ok(request, gateway.config.api_key):
        message = "missing or wrong API key (Authorization: Bearer …)"
        return _response(problem(401, message, "auth_error"))
    workers = gateway.pool.eligible("decode") + gateway.pool.eligible("prefill")
    if not workers:
        return _response(problem(503, "no worker is available", "no_available_workers"))
    unreachable = []
    for worker in workers:
        try:
            return await _first_found(gateway.client, worker.url, paths)
        except httpx.HTTPError as exc:
            unreachable.append(f"{worker.id} ({type(exc).__name__})")
    message = f"no worker could be reached: {', '.join(unreachable)}"
    return _response(problem(502, message, "upstream_error"))


async def _first_found(client: httpx.AsyncClient, url: str, paths: tuple[str, ...]) -> Response:
    """The worker's answer at the first of `paths` it has (its 404 for the last)."""
    for path in paths:
        response = await client.get(url + path, timeout=10.0)
        if response.status_code != 404 or path == paths[-1]:
            media = response.headers.get("content-type", "application/json")
            return Response(response.content, response.status_code, media_type=media)
    raise AssertionError("unreachable: paths is never empty")


def create_app(gateway: Gateway, *, run_monitor: bool = True) -> FastAPI:
    """The app serving `gateway`; its lifespan runs the monitor and drains on shutdown."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if run_monitor:
            gateway.monitor.start()
        try:
            yield
        finally:
            await gateway.close()

    app = FastAPI(title="globalkv gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = gateway

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await _proxy_get(gateway, request, ("/v1/models",))

    @app.get("/get_model_info")
    async def model_info(request: Request) -> Response:
        return await _proxy_get(gateway, request, ("/model_info", "/get_model_info"))

    @app.get("/get_server_info")
    async def server_info(request: Request) -> Response:
        return await _proxy_get(gateway, request, ("/server_info", "/get_server_info"))

    @app.get("/health")
    @app.get("/liveness")
    async def live() -> Response:
        # No `/version`: routers take a worker answering it for vLLM, and a gateway or a
        # sidecar sits where workers are expected (behind a picker, another router).
        return JSONResponse({"status": "ok", "version": VERSION})

    @app.get("/readiness")
    async def readiness() -> Response:
        counts: dict[str, Any] = {
            role: len(gateway.pool.eligible(role)) for role in ("prefill", "decode")
        }
        ready = counts["prefill"] > 0 and counts["decode"] > 0
        body = {"ready": ready, "eligible": counts}
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(admin_routes(gateway))
    return app
