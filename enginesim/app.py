"""SGLang's HTTP surface over either engine role, built by `create_app` with its collaborators.

Every generating endpoint runs one path: validate the body, expand it into prompts, start
them all (the first failure cancels the rest and answers with its stage and status), then
answer whole or as SSE while tokens arrive. A client that disconnects first has its
prompts cancelled at once (`kvplumbing.asgi`). `/server_info` (and `/get_server_info`)
advertises what a control plane needs to adopt the engine: its role, DP size, page size,
bootstrap port and, for a prefill, the `kv_events` block to subscribe to.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask

from enginesim.api_models import (
    MAX_BODY_BYTES,
    MAX_PROMPT_TOKENS,
    BadRequest,
    ChatRequest,
    CompletionRequest,
    GenerateRequest,
    chat_prompts,
    completion_prompts,
    generate_prompts,
)
from enginesim.engine import Engine, EngineError, Prompt
from enginesim.metrics import EngineMetrics
from enginesim.responses import (
    SSE_DONE,
    Element,
    Format,
    GenerateFormat,
    OpenAIFormat,
    error_body,
    sse,
)
from enginesim.textgen import ReplyWriter
from globalkv.tokenize import NotTokenizable, TokenizeError, Tokenizer
from kvplumbing.asgi import CLIENT_GONE_STATUS, BodyLimit, ClientGone, unless_client_leaves
from kvplumbing.validation import describe_errors

log = logging.getLogger(__name__)

_GENERATING = ("/generate", "/v1/completions", "/v1/chat/completions")


async def start_all(engine: Engine, prompts: Sequence[Prompt]) -> list[Element]:
    """Run every prompt to its first token; the first failure cancels the others."""
    started = time.monotonic()
    tasks = [asyncio.create_task(engine.generate(p)) for p in prompts]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            error = task.exception() if task.done() and not task.cancelled() else None
            if error is not None:
                raise error
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return [
        Element(index=i, prompt=p, generation=t.result(), started=started)
        for i, (p, t) in enumerate(zip(prompts, tasks, strict=True))
    ]


async def _pump(element: Element, queue: asyncio.Queue[tuple[Element, bool]]) -> None:
    try:
        async for token in element.generation.tokens:
            element.output_ids.append(token)
            queue.put_nowait((element, False))
    finally:
        queue.put_nowait((element, True))


async def _complete(elements: Sequence[Element]) -> None:
    async for _ in progress(elements):
        continue


async def progress(elements: Sequence[Element]) -> AsyncIterator[Element]:
    """Each element every time it gains tokens, and once more (finished) at its end."""
    queue: asyncio.Queue[tuple[Element, bool]] = asyncio.Queue()
    pumps = [asyncio.create_task(_pump(e, queue)) for e in elements]
    try:
        remaining = len(elements)
        while remaining:
            element, final = await queue.get()
            if final:
                element.finished = True
                remaining -= 1
            yield element
    finally:
        for pump in pumps:
            pump.cancel()
        for outcome in await asyncio.gather(*pumps, return_exceptions=True):
            if isinstance(outcome, Exception):
                log.error("token stream failed: %r", outcome)


def create_app(
    engine: Engine,
    *,
    tokenizer: Tokenizer,
    writer: ReplyWriter,
    metrics: EngineMetrics,
    max_new_tokens: int,
    model: str,
    server_info: Callable[[], dict[str, Any]],
    max_body_bytes: int = MAX_BODY_BYTES,
) -> FastAPI:
    """`server_info` gives the static part of `/server_info` (addresses, sizes)."""
    app = FastAPI(title=f"enginesim {engine.role}", docs_url=None, redoc_url=None)

    def fail(status: int, message: str, stage: str, endpoint: str) -> JSONResponse:
        metrics.requests.labels(endpoint, "error").inc()
        metrics.failures.labels(stage).inc()
        openai = endpoint.startswith("/v1/")
        return JSONResponse(error_body(status, message, stage, openai=openai), status_code=status)

    def too_large(path: str) -> Response:
        endpoint = path if path in _GENERATING else "other"  # no label per unknown path
        return fail(413, f"request body larger than {max_body_bytes} bytes", "request", endpoint)

    app.add_middleware(BodyLimit, limit=max_body_bytes, refuse=too_large)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = describe_errors(exc.errors(), most=5)
        return fail(422, f"invalid request body: {problems}", "request", request.url.path)

    async def serve(
        request: Request,
        endpoint: str,
        build: Callable[[], list[Prompt]],
        fmt: Format,
        stream: bool,
    ) -> Response:
        try:
            prompts = build()
        except (BadRequest, TokenizeError, NotTokenizable) as exc:
            return fail(400, str(exc), "request", endpoint)
        metrics.running_requests.inc(len(prompts))
        streaming = False
        try:
            elements = await unless_client_leaves(request.receive, start_all(engine, prompts))
            if stream:
                streaming = True
                return StreamingResponse(
                    _stream(endpoint, elements, fmt),
                    media_type="text/event-stream",
                    background=BackgroundTask(_stream_ended, len(prompts)),
                )
            await unless_client_leaves(request.receive, _complete(elements))
        except EngineError as exc:
            log.warning("%s failed at stage %s: %s", endpoint, exc.stage, exc.message)
            return fail(exc.status, exc.message, exc.stage, endpoint)
        except ClientGone:
            metrics.requests.labels(endpoint, "cancelled").inc()
            log.info("%s: the client left before its answer; its prompts were cancelled", endpoint)
            return Response(status_code=CLIENT_GONE_STATUS)
        finally:
            if not streaming:
                metrics.running_requests.dec(len(prompts))
        finish(endpoint, elements)
        return JSONResponse(fmt.body(elements))

    def finish(endpoint: str, elements: Sequence[Element]) -> None:
        metrics.requests.labels(endpoint, "ok").inc()
        metrics.generated_tokens.inc(sum(len(e.output_ids) for e in elements))

    async def _stream(endpoint: str, elements: list[Element], fmt: Format) -> AsyncIterator[bytes]:
        complete = False
        try:
            async for element in progress(elements):
                for payload in fmt.chunks(element):
                    yield sse(payload)
            for payload in fmt.tail(elements):
                yield sse(payload)
            yield SSE_DONE
            complete = True
        finally:
            if complete:
                finish(endpoint, elements)
            else:
                metrics.requests.labels(endpoint, "cancelled").inc()

    async def _stream_ended(prompts: int) -> None:
        """Run by Starlette after the stream, even one that never started (client gone)."""
        metrics.running_requests.dec(prompts)

    @app.post("/generate")
    async def generate(request: Request, body: GenerateRequest) -> Response:
        batch = isinstance(body.text, list) or bool(
            body.input_ids and isinstance(body.input_ids[0], list)
        )
        return await serve(
            request,
            "/generate",
            lambda: generate_prompts(body, tokenizer, max_new_tokens),
            GenerateFormat(writer, batch=batch),
            body.stream,
        )

    def openai(body: CompletionRequest | ChatRequest) -> OpenAIFormat:
        options = body.stream_options
        return OpenAIFormat(
            writer,
            chat=isinstance(body, ChatRequest),
            model=body.model or model,
            samples=body.n,
            include_usage=options is not None and options.include_usage,
        )

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        prompts = partial(completion_prompts, body, tokenizer)
        return await serve(request, "/v1/completions", prompts, openai(body), body.stream)

    @app.post("/v1/chat/completions")
    async def chat(request: Request, body: ChatRequest) -> Response:
        prompts = partial(chat_prompts, body, tokenizer, max_new_tokens)
        return await serve(request, "/v1/chat/completions", prompts, openai(body), body.stream)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def info() -> dict[str, Any]:
        return {**server_info(), **engine.server_info()}

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        return {
            "model_path": model,
            "tokenizer_path": tokenizer.name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "enginesim",
            "architectures": None,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": model,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "sglang",
                    "root": model,
                    "max_model_len": MAX_PROMPT_TOKENS,
                }
            ],
        }

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        await engine.flush_cache()
        return Response("Cache flushed.\n", media_type="text/plain")

    @app.post("/_sim/restart")
    async def restart() -> dict[str, Any]:
        """Emulate an engine restart: KV gone, event seqs back to 0, a clear published."""
        await engine.restart()
        log.info("simulated restart: KV cache emptied, KV-event seq reset")
        return {"restarted": True, **engine.server_info()}

    return app
