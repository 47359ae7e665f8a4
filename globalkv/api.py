"""The indexer's HTTP API: pods, lookups, health, metrics.

Lookups answer in `globalkv.lookup.LookupResult`'s shape, which `HttpLookup` (the
gateway's client) reads back. When the index cannot answer truthfully — its backend is
unreachable, or sources are still being rebuilt after it lost its data — the answer is
503 with a message, never a guess: the gateway then routes by load.

Every outside input is validated: bodies by pydantic (422 with the field), oversized
bodies (413) before they are read whole, token counts (413), an unknown pod (404), a pod
whose block size the index cannot key or whose endpoint is not tcp:// without the operator
allowing it (400), a bound topic that already names another pod (409).

Registering a pod makes the indexer connect wherever the pod says and feed the index what
arrives there, so the mutating endpoints are in protected mode (`kvplumbing.auth`): with an
admin token they need it (401), without one they answer only loopback clients (403 for
others, saying how to open them) unless `--insecure`. Lookups are tenants' data — whether
a prompt's prefix is cached is whether someone sent it — so they are protected alike
unless `--open-lookups`; a salted prompt's chain is found only with its salt
(`globalkv.keys`). The other reads (pods, health, metrics) answer anyone.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from functools import partial
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ConfigDict, Field, model_validator

from globalkv.index.base import Index, IndexUnavailable
from globalkv.ingest.config import EndpointRefused
from globalkv.ingest.followed import TopicTaken
from globalkv.ingest.leases import Leases
from globalkv.ingest.service import IngestService
from globalkv.lookup import IndexLookup
from globalkv.metrics import ApiMetrics
from globalkv.registry import PodInfo, PodState, Registry
from globalkv.tokenize import Tokenizer
from kvplumbing.asgi import BodyLimit
from kvplumbing.auth import ProtectedMode, ProtectionFlags
from kvplumbing.release import VERSION

TokenId = Annotated[int, Field(ge=0, le=2**32 - 1)]
OPEN_LOOKUPS_FLAG = "--open-lookups"


class ApiConfig(BaseModel):
    admin_token: str | None = Field(
        None,
        min_length=1,
        repr=False,
        description="Required as `Authorization: Bearer …` on mutating endpoints; without "
        "one they answer only loopback clients.",
    )
    insecure: bool = Field(
        False, description="Without an admin token, accept mutations and lookups from any host."
    )
    open_lookups: bool = Field(
        False,
        description="Answer lookups from any host without a token (they tell which prompts "
        "the cache holds); mutations stay protected.",
    )
    max_body_bytes: int = Field(8 << 20, ge=1024, description="Largest request body.")
    max_tokens: int = Field(262_144, ge=1, description="Most tokens one lookup may carry.")

    def protected_mode(self) -> ProtectedMode:
        flags = ProtectionFlags("indexer")
        return ProtectedMode("the indexer", self.admin_token, self.insecure, flags)


class LookupRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(max_length=512)
    token_ids: list[TokenId] | None = None
    text: str | None = Field(None, description="Tokenized with the configured tokenizer.")
    lora_name: str | None = Field(None, max_length=512)
    cache_salt: str | None = Field(None, max_length=512)

    @model_validator(mode="after")
    def _one_prompt(self) -> LookupRequest:
        if (self.token_ids is None) == (self.text is None):
            raise ValueError("give exactly one of token_ids and text")
        return self


class PodHitOut(BaseModel):
    pod: str
    dp_rank: int
    hit_blocks: int
    hit_tokens: int
    score: float


class LookupResponse(BaseModel):
    block_size: int
    blocks: int
    pods: list[PodHitOut]


class PodOut(PodInfo):
    model_config = ConfigDict(extra="forbid")

    owner: str | None = None
    """The indexer following the pod: this one, or with replicas the lease's holder."""
    state: PodState | None = None


class PodList(BaseModel):
    pods: list[PodOut]


class Health(BaseModel):
    status: str
    """ok; degraded (lookups answer, but the index refuses writes: it falls behind the
    engines); resyncing (503: lookups refused while sources are rebuilt)."""
    version: str
    pods: int
    resyncing_sources: int
    held_sources: int = 0
    reason: str | None = None
    """Why not ok, in words."""


def _too_large(limit: int, path: str) -> Response:
    return JSONResponse({"detail": f"request body larger than {limit} bytes"}, status_code=413)


def _unavailable(exc: IndexUnavailable) -> HTTPException:
    return HTTPException(503, f"index unavailable: {exc}")


class _IndexRoutes:
    """The API's handlers, over the indexer's parts; `create_app` puts each on its path."""

    def __init__(
        self,
        config: ApiConfig,
        *,
        index: Index,
        registry: Registry,
        ingest: IngestService,
        metrics_registry: CollectorRegistry,
        tokenizer: Tokenizer | None,
        member: str | None,
        leases: Leases | None,
    ) -> None:
        self.config = config
        self.member = member
        self.leases = leases
        self.index = index
        self.registry = registry
        self.ingest = ingest
        self.metrics_registry = metrics_registry
        self.tokenizer = tokenizer
        self.metrics = ApiMetrics(metrics_registry)
        self.lookup = IndexLookup(index)
        self.protected = config.protected_mode()

    async def count(self, request: Request, call_next: Callable[[Request], Any]) -> Response:
        """Middleware: every answer counted by route template and status."""
        response: Response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", "unmatched")
        self.metrics.requests.labels(path, str(response.status_code)).inc()
        return response

    def admin(self, request: Request) -> None:
        """Dependency of the mutating endpoints: protected mode."""
        refusal = self.protected.check_request(request)
        if refusal is not None:
            raise HTTPException(refusal.status, refusal.message)

    def reader(self, request: Request) -> None:
        """Dependency of lookups: protected mode too, unless lookups were opened. A lookup
        answers "has anyone sent this prompt?"; a salted prompt's chain needs its salt."""
        if self.config.open_lookups:
            return
        refusal = self.protected.check_request(request, reads=OPEN_LOOKUPS_FLAG)
        if refusal is not None:
            raise HTTPException(refusal.status, refusal.message)

    def _require_ready(self) -> None:
        recovery = self.ingest.recovery
        if not recovery.ready:
            left = len(recovery.resyncing)
            raise HTTPException(503, f"index resyncing after data loss ({left} sources left)")

    async def _token_ids(self, body: LookupRequest) -> list[int]:
        if body.text is None:
            assert body.token_ids is not None
            return body.token_ids
        if self.tokenizer is None:
            raise HTTPException(400, "no tokenizer is configured: send token_ids")
        try:
            # Off the loop: megabytes of text take seconds to encode, and ingest and
            # every other request share this loop (the Rust encoder releases the GIL).
            return await asyncio.to_thread(self.tokenizer.encode, body.text)
        except ValueError as exc:
            raise HTTPException(400, f"cannot tokenize text: {exc}") from exc

    async def post_lookup(self, body: LookupRequest) -> LookupResponse:
        started = time.perf_counter()
        token_ids = await self._token_ids(body)
        if len(token_ids) > self.config.max_tokens:
            raise HTTPException(
                413, f"{len(token_ids)} tokens is over the limit of {self.config.max_tokens}"
            )
        self._require_ready()
        try:
            result = await self.lookup.lookup(
                body.model, token_ids, body.lora_name, body.cache_salt
            )
        except IndexUnavailable as exc:
            raise _unavailable(exc) from exc
        self._require_ready()
        self.metrics.lookup_seconds.observe(time.perf_counter() - started)
        return LookupResponse(
            block_size=result.block_size,
            blocks=result.blocks,
            pods=[
                PodHitOut(
                    pod=h.pod,
                    dp_rank=h.dp_rank,
                    hit_blocks=h.hit_blocks,
                    hit_tokens=h.hit_tokens,
                    score=h.score,
                )
                for h in result.pods
            ],
        )

    async def post_pod(self, pod: PodInfo) -> PodOut:
        if pod.block_size is not None and pod.block_size % self.index.block_size:
            raise HTTPException(
                400,
                f"block_size {pod.block_size} is not a multiple of the index block size "
                f"{self.index.block_size}: its blocks cannot be keyed",
            )
        try:
            self.ingest.following.check(pod)
            await self.registry.put(pod)
            await self.ingest.following.add(pod)
        except EndpointRefused as exc:
            raise HTTPException(400, str(exc)) from exc
        except TopicTaken as exc:
            raise HTTPException(409, str(exc)) from exc
        except IndexUnavailable as exc:
            raise _unavailable(exc) from exc
        state = self.ingest.states().get(pod.id)
        return PodOut(**pod.model_dump(), owner=None if state is None else self.member, state=state)

    async def get_pods(self) -> PodList:
        """Every registered pod with its follower and that one's ingest state: ours for a
        pod this indexer follows; with replicas, the lease holder's as it last wrote it to
        the registry; none for a pod nobody follows (the registry's copy of a state may be
        an older process's)."""
        states = self.ingest.states()
        try:
            pods = await self.registry.list()
            owners = {} if self.leases is None else await self.leases.owners([p.id for p in pods])
            shared = await self.registry.states() if set(owners) - set(states) else {}
        except IndexUnavailable as exc:
            raise _unavailable(exc) from exc
        out = []
        for pod in pods:
            owner = owners.get(pod.id)
            if pod.id in states and owner in (None, self.member):
                out.append(PodOut(**pod.model_dump(), owner=self.member, state=states[pod.id]))
            else:
                out.append(PodOut(**pod.model_dump(), owner=owner, state=shared.get(pod.id)))
        return PodList(pods=out)

    async def delete_pod(self, pod_id: str) -> dict[str, str]:
        try:
            known = await self.registry.remove(pod_id)
        except IndexUnavailable as exc:
            raise _unavailable(exc) from exc
        try:
            followed = await self.ingest.following.remove(pod_id)
        except IndexUnavailable as exc:
            raise HTTPException(
                503,
                f"pod {pod_id} is no longer followed; its blocks are cleared once the "
                f"index answers again ({exc})",
            ) from exc
        if not (known or followed):
            raise HTTPException(404, f"no pod {pod_id!r}")
        return {"removed": pod_id}

    async def health(self, response: Response) -> Health:
        recovery = self.ingest.recovery
        held = recovery.held
        status, reason = "ok", None
        if not recovery.ready:
            response.status_code = 503
            status, reason = "resyncing", "sources are rebuilt after the index lost data"
        elif held:
            status = "degraded"
            reason = (
                f"the index refuses the writes of {len(held)} sources (held, retried): "
                f"{next(iter(held.values()))}"
            )
        return Health(
            status=status,
            version=VERSION,
            pods=len(self.ingest.following.pods()),
            resyncing_sources=len(recovery.resyncing),
            held_sources=len(held),
            reason=reason,
        )

    async def version(self) -> dict[str, str]:
        return {"version": VERSION}

    async def get_metrics(self) -> Response:
        return Response(generate_latest(self.metrics_registry), media_type=CONTENT_TYPE_LATEST)


async def _invalid_body(request: Request, exc: RequestValidationError) -> Response:
    """FastAPI's 422 without the offending values: its own echoes them, and a NaN or a lone
    surrogate among them made the answer itself fail, a 500. ASCII, for the same reason."""
    detail = [{"type": e["type"], "loc": e["loc"], "msg": e["msg"]} for e in exc.errors()]
    body = json.dumps({"detail": detail}, ensure_ascii=True)
    return Response(body, status_code=422, media_type="application/json")


def create_app(
    config: ApiConfig,
    *,
    index: Index,
    registry: Registry,
    ingest: IngestService,
    metrics_registry: CollectorRegistry,
    tokenizer: Tokenizer | None = None,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None,
    member: str | None = None,
    leases: Leases | None = None,
) -> FastAPI:
    """`member`: this indexer's name, shown as the owner of the pods it follows; `leases`:
    where replicas' owners are read."""
    app = FastAPI(
        title="globalkv indexer",
        description="Which pod holds how long a prefix of a prompt's KV cache.",
        lifespan=lifespan,
    )
    app.add_middleware(
        BodyLimit, limit=config.max_body_bytes, refuse=partial(_too_large, config.max_body_bytes)
    )
    app.exception_handler(RequestValidationError)(_invalid_body)
    routes = _IndexRoutes(
        config,
        index=index,
        registry=registry,
        ingest=ingest,
        metrics_registry=metrics_registry,
        tokenizer=tokenizer,
        member=member,
        leases=leases,
    )
    app.middleware("http")(routes.count)
    admin = [Depends(routes.admin)]
    app.add_api_route(
        "/v1/lookup",
        routes.post_lookup,
        methods=["POST"],
        response_model=LookupResponse,
        dependencies=[Depends(routes.reader)],
    )
    app.add_api_route(
        "/v1/pods",
        routes.post_pod,
        methods=["POST"],
        status_code=201,
        response_model=PodOut,
        dependencies=admin,
    )
    app.add_api_route("/v1/pods", routes.get_pods, methods=["GET"], response_model=PodList)
    app.add_api_route(
        "/v1/pods/{pod_id}", routes.delete_pod, methods=["DELETE"], dependencies=admin
    )
    app.add_api_route("/health", routes.health, methods=["GET"], response_model=Health)
    app.add_api_route("/version", routes.version, methods=["GET"])
    app.add_api_route("/metrics", routes.get_metrics, methods=["GET"])
    return app
