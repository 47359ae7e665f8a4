"""The gateway as an ASGI app: sglang-router's endpoints, inference, info, health, metrics.

Inference POSTs (`/generate`, `/v1/completions`, `/v1/chat/completions`) are answered by
`_InferenceRoutes`, a plain ASGI layer in front of FastAPI: no routing table, no Request
object, the work itself in `gateway.inference`. A client that goes away cancels both
upstream calls: a non-streamed request races the work against the ASGI disconnect
message; a stream listens for it while passing pieces on. The gateway's own server
(`gateway.server`) answers inference itself and hands every other request to this app;
under any ASGI server the app serves all of them. The worker admin API lives in
`gateway.admin`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.admin import admin_routes
from gateway.inference import INFERENCE_PATHS, Inference, Relay, problem, too_large
from gateway.inject import Endpoint
from gateway.service import Gateway
from gateway.upstream import Answer
from kvplumbing.asgi import (
    CLIENT_GONE_STATUS,
    BodyTooLarge,
    ClientGone,
    read_body,
    unless_client_leaves,
    until_disconnected,
)
from kvplumbing.auth import bearer_ok


def _response(answer: Answer) -> Response:
    return Response(answer.body, answer.status, media_type=answer.media_type.decode("latin-1"))


async def _send_answer(send: Send, answer: Answer, *extra: tuple[bytes, bytes]) -> None:
    headers = [(b"content-type", answer.media_type), (b"content-length", b"%d" % len(answer.body))]
    headers += extra
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body})


class _InferenceRoutes:
    """Inference POSTs from ASGI messages to `Inference`; everything else to `app`."""

    def __init__(self, app: ASGIApp, inference: Inference) -> None:
        self.app = app
        self.inference = inference

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = INFERENCE_PATHS.get(scope["path"]) if scope["type"] == "http" else None
        if endpoint is None:
            await self.app(scope, receive, send)
        elif scope["method"] != "POST":
            answer = problem(405, f"{scope['path']} takes POST")
            await _send_answer(send, answer, (b"allow", b"POST"))
        else:
            with contextlib.suppress(ClientGone):
                await self._serve(endpoint, scope, receive, send)

    async def _serve(self, endpoint: Endpoint, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.inference.max_payload_size
        try:
            raw = await read_body(scope, receive, limit)
        except BodyTooLarge:
            await _send_answer(send, self.inference.refuse(endpoint, too_large(limit)))
            return
        authorization = dict(scope["headers"]).get(b"authorization")
        work = self.inference.handle(
            endpoint,
            scope["path"],
            None if authorization is None else authorization.decode("latin-1"),
            raw,
        )
        try:
            outcome = await unless_client_leaves(receive, work, abandon=_abandon)
        except ClientGone:
            await _send_answer(send, Answer(CLIENT_GONE_STATUS, b""))
            return
        if isinstance(outcome, Relay):
            await _stream(outcome, receive, send)
        else:
            await _send_answer(send, outcome)


async def _abandon(outcome: Answer | Relay) -> None:
    """An answer reached after its client left: a stream is released, unread."""
    if isinstance(outcome, Relay):
        await outcome.abandon()


async def _stream(relay: Relay, receive: Receive, send: Send) -> None:
    """Pass the stream on, noticing a client that leaves even while the decode is silent."""
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in relay.headers.items()]
    await send({"type": "http.response.start", "status": relay.status, "headers": headers})

    async def piece(chunk: bytes) -> None:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})

    async def run() -> None:
        with contextlib.suppress(OSError):
            await piece(relay.first)
            await relay.run(piece)
            await send({"type": "http.response.body", "body": b""})

    passing = asyncio.ensure_future(run())
    listening = asyncio.ensure_future(until_disconnected(receive))
    try:
        await asyncio.wait({passing, listening}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listening.cancel()
        passing.cancel()
        await asyncio.wait({passing, listening})


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

    app.add_middleware(_InferenceRoutes, inference=Inference(gateway))

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
        return JSONResponse({"status": "ok"})

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
