"""SGLang's HTTP surface over either engine role, built by `create_app` with its collaborators.

Every generating endpoint runs one path: validate the body, expand it into prompts, start
them all (the first failure cancels the rest and answers with its stage and status), then
answer whole or as SSE while tokens arrive. A client that disconnects first has its
prompts cancelled at once (`kvplumbing.asgi`). `/server_info` (and `/get_server_info`)
advertises what a control plane needs to adopt the engine: its role, DP size, page size,
bootstrap port and, for a prefill, the `kv_events` block to subscribe to.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
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
    TenantFields,
    cache_namespace,
    chat_prompts,
    completion_prompts,
    generate_prompts,
)
from enginesim.engine import Api, Engine, EngineError, Prompt
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
from enginesim.running import complete, progress, start_all
from enginesim.textgen import ReplyWriter
from globalkv.tokenize import NotTokenizable, TokenizeError, Tokenizer
from kvplumbing.asgi import CLIENT_GONE_STATUS, BodyLimit, ClientGone, unless_client_leaves
from kvplumbing.release import VERSION
from kvplumbing.validation import describe_errors

log = logging.getLogger(__name__)

_GENERATING = ("/generate", "/v1/completions", "/v1/chat/completions")


def _model_info(model: str, tokenizer: Tokenizer) -> dict[str, Any]:
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


def _models(model: str, owner: str, adapters: Sequence[str]) -> dict[str, Any]:
    """The served model, then each LoRA adapter with the model as its `parent`, as vLLM's
    and SGLang's `/v1/models` list them."""
    created = int(time.time())
    card = {"object": "model", "created": created, "owned_by": owner}
    base = {**card, "id": model, "root": model, "parent": None, "max_model_len": MAX_PROMPT_TOKENS}
    loras = [
        {**card, "id": name, "root": f"/adapters/{name}", "parent": model, "max_model_len": None}
        for name in adapters
    ]
    return {"object": "list", "data": [base, *loras]}


class _EngineRoutes:
    """SGLang's endpoints over one engine; `create_app` puts each on its path."""

    def __init__(
        self,
        engine: Engine,
        *,
        tokenizer: Tokenizer,
        writer: ReplyWriter,
        metrics: EngineMetrics,
        max_new_tokens: int,
        model: str,
        server_info: Callable[[], dict[str, Any]],
        max_body_bytes: int,
        api: Api,
        adapters: Sequence[str],
    ) -> None:
        self.engine = engine
        self.api = api
        self.adapters = adapters
        self.tokenizer = tokenizer
        self.writer = writer
        self.metrics = metrics
        self.max_new_tokens = max_new_tokens
        self.model = model
        self.server_info = server_info
        self.max_body_bytes = max_body_bytes

    # ------------------------------------------------------------ failures

    def fail(self, status: int, message: str, stage: str, endpoint: str) -> JSONResponse:
        self.metrics.requests.labels(endpoint, "error").inc()
        self.metrics.failures.labels(stage).inc()
        openai = endpoint.startswith("/v1/")
        return JSONResponse(error_body(status, message, stage, openai=openai), status_code=status)

    def too_large(self, path: str) -> Response:
        """`BodyLimit`'s answer to an oversized body."""
        endpoint = path if path in _GENERATING else "other"  # no label per unknown path
        message = f"request body larger than {self.max_body_bytes} bytes"
        return self.fail(413, message, "request", endpoint)

    async def invalid_body(self, request: Request, exc: RequestValidationError) -> Response:
        """FastAPI's `RequestValidationError`, answered as SGLang's error body."""
        problems = describe_errors(exc.errors(), most=5)
        return self.fail(422, f"invalid request body: {problems}", "request", request.url.path)

    # ------------------------------------------------------------ generating

    async def generate(self, request: Request, body: GenerateRequest) -> Response:
        batch = isinstance(body.text, list) or bool(
            body.input_ids and isinstance(body.input_ids[0], list)
        )
        return await self._serve(
            request,
            "/generate",
            self._namespaced(
                body, None, partial(generate_prompts, body, self.tokenizer, self.max_new_tokens)
            ),
            GenerateFormat(self.writer, batch=batch),
            body.stream,
        )

    async def completions(self, request: Request, body: CompletionRequest) -> Response:
        prompts = partial(completion_prompts, body, self.tokenizer)
        return await self._serve(
            request,
            "/v1/completions",
            self._namespaced(body, body.model, prompts),
            self._openai(body),
            body.stream,
        )

    async def chat(self, request: Request, body: ChatRequest) -> Response:
        prompts = partial(chat_prompts, body, self.tokenizer, self.max_new_tokens)
        return await self._serve(
            request,
            "/v1/chat/completions",
            self._namespaced(body, body.model, prompts),
            self._openai(body),
            body.stream,
        )

    def _namespaced(
        self, body: TenantFields, model: str | None, build: Callable[[], list[Prompt]]
    ) -> Callable[[], list[Prompt]]:
        """`build`, its prompts cached under the body's LoRA adapter and salt."""

        def built() -> list[Prompt]:
            namespace = cache_namespace(body, model, self.api, self.model, self.adapters)
            return [replace(p, namespace=namespace) for p in build()]

        return built

    def _openai(self, body: CompletionRequest | ChatRequest) -> OpenAIFormat:
        options = body.stream_options
        return OpenAIFormat(
            self.writer,
            chat=isinstance(body, ChatRequest),
            model=body.model or self.model,
            samples=body.n,
            include_usage=options is not None and options.include_usage,
            transfer_params=self.api == "vllm",
        )

    async def _serve(
        self,
        request: Request,
        endpoint: str,
        build: Callable[[], list[Prompt]],
        fmt: Format,
        stream: bool,
    ) -> Response:
        """Every generating endpoint: prompts built, started, answered whole or streamed."""
        try:
            prompts = build()
        except (BadRequest, TokenizeError, NotTokenizable) as exc:
            return self.fail(400, str(exc), "request", endpoint)
        request_id = request.headers.get("x-request-id") if self.api == "vllm" else None
        headers = None
        if request_id:
            prompts = [replace(p, request_id=request_id) for p in prompts]
            headers = {"x-request-id": request_id}
        metrics = self.metrics
        metrics.running_requests.inc(len(prompts))
        streaming = False
        try:
            elements = await unless_client_leaves(request.receive, start_all(self.engine, prompts))
            if stream:
                streaming = True
                return StreamingResponse(
                    self._stream(endpoint, elements, fmt),
                    media_type="text/event-stream",
                    headers=headers,
                    background=BackgroundTask(self._stream_ended, len(prompts)),
                )
            await unless_client_leaves(request.receive, complete(elements))
        except EngineError as exc:
            log.warning("%s failed at stage %s: %s", endpoint, exc.stage, exc.message)
            return self.fail(exc.status, exc.message, exc.stage, endpoint)
        except ClientGone:
            metrics.requests.labels(endpoint, "cancelled").inc()
            log.info("%s: the client left before its answer; its prompts were cancelled", endpoint)
            return Response(status_code=CLIENT_GONE_STATUS)
        finally:
            if not streaming:
                metrics.running_requests.dec(len(prompts))
        self._finish(endpoint, elements)
        return JSONResponse(fmt.body(elements), headers=headers)

    def _finish(self, endpoint: str, elements: Sequence[Element]) -> None:
        self.metrics.requests.labels(endpoint, "ok").inc()
        self.metrics.generated_tokens.inc(sum(len(e.output_ids) for e in elements))

    async def _stream(
        self, endpoint: str, elements: list[Element], fmt: Format
    ) -> AsyncIterator[bytes]:
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
                self._finish(endpoint, elements)
            else:
                self.metrics.requests.labels(endpoint, "cancelled").inc()

    async def _stream_ended(self, prompts: int) -> None:
        """Run by Starlette after the stream, even one that never started (client gone)."""
        self.metrics.running_requests.dec(prompts)

    # ------------------------------------------------------------ the rest

    async def health(self) -> Response:
        return Response(status_code=200)

    async def info(self) -> dict[str, Any]:
        return {**self.server_info(), **self.engine.server_info(), "version": VERSION}

    async def model_info(self) -> dict[str, Any]:
        return _model_info(self.model, self.tokenizer)

    async def models(self) -> dict[str, Any]:
        return _models(self.model, self.api, self.adapters)

    async def version(self) -> dict[str, Any]:
        """vLLM's `/version`, which routers read to tell a vLLM worker from SGLang's."""
        return {"version": VERSION}

    async def prometheus(self) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def flush_cache(self) -> Response:
        await self.engine.flush_cache()
        return Response("Cache flushed.\n", media_type="text/plain")

    async def cache(self) -> dict[str, Any]:
        """What the emulated cache holds, by DP rank: every cached prefix's tokens."""
        chains = self.engine.cached_chains()
        return {"ranks": [{"dp_rank": rank, "prefixes": chains[rank]} for rank in sorted(chains)]}

    async def restart(self) -> dict[str, Any]:
        """Emulate an engine restart: KV gone, event seqs back to 0, a clear published."""
        await self.engine.restart()
        log.info("simulated restart: KV cache emptied, KV-event seq reset")
        return {"restarted": True, **self.engine.server_info()}


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
    api: Api = "sglang",
    adapters: Sequence[str] = (),
) -> FastAPI:
    """`server_info` gives the static part of `/server_info` (addresses, sizes)."""
    routes = _EngineRoutes(
        engine,
        tokenizer=tokenizer,
        writer=writer,
        metrics=metrics,
        max_new_tokens=max_new_tokens,
        model=model,
        server_info=server_info,
        max_body_bytes=max_body_bytes,
        api=api,
        adapters=adapters,
    )
    app = FastAPI(title=f"enginesim {engine.role}", docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, limit=max_body_bytes, refuse=routes.too_large)
    app.exception_handler(RequestValidationError)(routes.invalid_body)
    route = app.add_api_route
    route("/generate", routes.generate, methods=["POST"])
    route("/v1/completions", routes.completions, methods=["POST"])
    route("/v1/chat/completions", routes.chat, methods=["POST"])
    route("/health", routes.health, methods=["GET", "HEAD"])
    for path in ("/server_info", "/get_server_info"):
        route(path, routes.info, methods=["GET"])
    for path in ("/get_model_info", "/model_info"):
        route(path, routes.model_info, methods=["GET"])
    route("/v1/models", routes.models, methods=["GET"])
    if api == "vllm":
        route("/version", routes.version, methods=["GET"])
    route("/metrics", routes.prometheus, methods=["GET"])
    route("/flush_cache", routes.flush_cache, methods=["GET", "POST"])
    route("/_sim/restart", routes.restart, methods=["POST"])
    route("/_sim/cache", routes.cache, methods=["GET"])
    return app
