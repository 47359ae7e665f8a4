"""The gateway's HTTP surface, sglang-router's endpoints: inference, info, health, metrics.

Inference (`/generate`, `/v1/completions`, `/v1/chat/completions`): size limit, API key,
body checks (400 with the reason), tokens, one index lookup, then the dispatcher. A client
that goes away cancels both upstream calls: non-streamed requests race the dispatcher
against the ASGI disconnect message; streams listen for it while passing chunks on.
The worker admin API lives in `gateway.admin`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import Receive, Scope, Send

from gateway.admin import admin_routes
from gateway.auth import bearer_ok
from gateway.dispatch import Answer, Stream, error_body
from gateway.inject import Endpoint
from gateway.policies.base import RouteRequest
from gateway.requests import BadRequest, parse_request, prompt_tokens
from gateway.service import Gateway
from globalkv.tokenize import TokenizeError


class HTTPProblem(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


def problem(status: int, message: str, kind: str = "invalid_request_error") -> Response:
    return Response(error_body(message, kind), status, media_type="application/json")


def require_api_key(request: Request, gateway: Gateway) -> None:
    if not bearer_ok(request, gateway.config.api_key):
        raise HTTPProblem(401, "missing or wrong API key (Authorization: Bearer …)", "auth_error")


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPProblem(413, f"request body exceeds --max-payload-size ({limit} bytes)")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPProblem(413, f"request body exceeds --max-payload-size ({limit} bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


class _PassThrough(StreamingResponse):
    """A stream that notices a client leaving even while the decode is silent."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:

            async def stream() -> None:
                with contextlib.suppress(OSError):
                    await self.stream_response(send)
                group.cancel_scope.cancel()

            group.start_soon(stream)
            await self.listen_for_disconnect(receive)
            group.cancel_scope.cancel()


async def _until_disconnect(
    request: Request, work: Awaitable[Answer | Stream]
) -> Answer | Stream | None:
    """`work`'s result, or None after cancelling it because the client went away."""
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        outcome = await task
        if isinstance(outcome, Stream):
            await outcome.close("client_gone")
    return None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _stream_response(gateway: Gateway, endpoint: str, stream: Stream, started: float) -> Response:
    metrics = gateway.metrics

    async def body() -> AsyncIterator[bytes]:
        outcome = "client_gone"
        try:
            yield stream.first
            async for chunk in stream.rest:
                yield chunk
            outcome = "done"
        except httpx.HTTPError:
            outcome = "upstream_error"
        finally:
            await stream.close(outcome)
            metrics.latency.labels(endpoint).observe(gateway.clock() - started)
            metrics.requests.labels(endpoint, str(stream.status)).inc()

    return _PassThrough(body(), status_code=stream.status, headers=stream.headers)


async def inference(gateway: Gateway, request: Request, endpoint: Endpoint, path: str) -> Response:
    started = gateway.clock()
    metrics = gateway.metrics
    try:
        require_api_key(request, gateway)
        raw = await read_body(request, gateway.config.max_payload_size)
        try:
            body: object = json.loads(raw)
        except ValueError as exc:
            raise HTTPProblem(400, f"the request body is not valid JSON: {exc}") from exc
        parsed = parse_request(endpoint, body)
        tokens = prompt_tokens(parsed, gateway.tokenizer)
    except HTTPProblem as exc:
        metrics.requests.labels(endpoint, str(exc.status)).inc()
        return problem(exc.status, str(exc), exc.kind)
    except (BadRequest, TokenizeError) as exc:
        metrics.requests.labels(endpoint, "400").inc()
        return problem(400, str(exc))
    lookup = await gateway.router.lookup(tokens.tokens, tokens.missing)
    route = RouteRequest(tokens.tokens, tokens.text, lookup, now=gateway.clock())
    outcome = await _until_disconnect(request, gateway.dispatcher.forward(parsed, route, path))
    metrics.ttfb.labels(endpoint).observe(gateway.clock() - started)
    if outcome is None:
        metrics.requests.labels(endpoint, "499").inc()
        return Response(status_code=499)
    if isinstance(outcome, Stream):
        return _stream_response(gateway, endpoint, outcome, started)
    metrics.latency.labels(endpoint).observe(gateway.clock() - started)
    metrics.requests.labels(endpoint, str(outcome.status)).inc()
    return Response(outcome.body, outcome.status, media_type=outcome.media_type)


async def _proxy_get(gateway: Gateway, request: Request, paths: tuple[str, ...]) -> Response:
    """A GET answered by one eligible worker (decodes first), trying each path in turn."""
    try:
        require_api_key(request, gateway)
    except HTTPProblem as exc:
        return problem(exc.status, str(exc), exc.kind)
    workers = gateway.pool.eligible("decode") + gateway.pool.eligible("prefill")
    if not workers:
        return problem(503, "no worker is available", "no_available_workers")
    worker = workers[0]
    for path in paths:
        try:
            response = await gateway.client.get(worker.url + path, timeout=10.0)
        except httpx.HTTPError as exc:
            return problem(502, f"worker {worker.id} unreachable: {exc!r}", "upstream_error")
        if response.status_code != 404 or path == paths[-1]:
            media = response.headers.get("content-type", "application/json")
            return Response(response.content, response.status_code, media_type=media)
    raise AssertionError("unreachable: paths is never empty")


INFERENCE_PATHS: dict[str, Endpoint] = {
    "/generate": "generate",
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
}


def _inference_route(
    gateway: Gateway, endpoint: Endpoint, path: str
) -> Callable[[Request], Awaitable[Response]]:
    async def route(request: Request) -> Response:
        return await inference(gateway, request, endpoint, path)

    return route


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

    @app.exception_handler(HTTPProblem)
    async def _problem(_: Request, exc: HTTPProblem) -> Response:
        return problem(exc.status, str(exc), exc.kind)

    # Plain Starlette routes: FastAPI's per-request dependency solving is a measurable
    # share of the gateway's cost (bench.gateway) and these handlers need none of it.
    for path, endpoint in INFERENCE_PATHS.items():
        app.add_route(path, _inference_route(gateway, endpoint, path), methods=["POST"])

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


def metrics_app(gateway: Gateway) -> FastAPI:
    """The separate `--prometheus-port` listener."""
    app = FastAPI(docs_url=None, redoc_url=None)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
