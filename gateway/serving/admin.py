"""The operators' API: the workers (`GET|POST /workers`, `GET|DELETE /workers/{id}`) and
the settings in force (`GET /v1/config`).

Reads need the API key or the admin token when one is set. Mutations are in protected
mode (`kvplumbing.auth`): they need `Authorization: Bearer <--admin-token>` when one is
set (else the API key when that is set), and without either they are answered only for
loopback clients unless `--insecure` (403, saying how to open them, for other hosts).
A worker is named by its id (`host:port`) or its URL. The body of
`POST /workers` is a `WorkerSpec`; sglang-router's `worker_type` is accepted for `role`.
Adding a prefill registers it as a pod with the index once its KV-event endpoints are
known (given here, or discovered by the monitor from its /server_info).
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from gateway.settings.workers import WorkerSpec
from gateway.workers.monitor import RegistrationFailed
from gateway.workers.pool import DuplicateWorker
from kvplumbing.auth import bearer_ok
from kvplumbing.validation import validation_message

if TYPE_CHECKING:
    from gateway.serving.service import Gateway

log = logging.getLogger(__name__)


def _error(status: int, message: str, kind: str = "invalid_request_error") -> Response:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


def _spec(body: object) -> WorkerSpec:
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    data: dict[str, Any] = dict(body)
    if "worker_type" in data and "role" not in data:
        data["role"] = data.pop("worker_type")
    return WorkerSpec.model_validate(data)


def admin_routes(gateway: Gateway) -> APIRouter:
    routes = APIRouter()
    protected = gateway.config.protected_mode()
    read_secrets = [s for s in (gateway.config.api_key, gateway.config.admin_token) if s]

    def may_read(request: Request) -> bool:
        return not read_secrets or any(bearer_ok(request, s) for s in read_secrets)

    def refusal(request: Request) -> Response | None:
        refused = protected.check_request(request)
        if refused is None:
            return None
        return _error(refused.status, refused.message, "auth_error")

    @routes.get("/v1/config")
    async def settings(request: Request) -> Response:
        if not may_read(request):
            return _error(401, "missing or wrong token", "auth_error")
        return JSONResponse(gateway.effective_config())

    @routes.get("/workers")
    async def list_workers(request: Request) -> Response:
        if not may_read(request):
            return _error(401, "missing or wrong token", "auth_error")
        now = gateway.clock()
        return JSONResponse({"workers": [w.describe(gateway.loads, now) for w in gateway.pool]})

    @routes.post("/workers")
    async def add_worker(request: Request) -> Response:
        if (refused := refusal(request)) is not None:
            return refused
        try:
            spec = _spec(json.loads(await request.body()))
        except ValidationError as exc:
            return _error(400, validation_message(exc))
        except ValueError as exc:
            return _error(400, f"invalid worker: {exc}")
        try:
            worker = gateway.add_worker(spec)
        except DuplicateWorker as exc:
            return _error(409, str(exc), "conflict")
        return JSONResponse(worker.describe(gateway.loads, gateway.clock()), status_code=201)

    @routes.get("/workers/{key:path}")
    async def get_worker(key: str, request: Request) -> Response:
        if not may_read(request):
            return _error(401, "missing or wrong token", "auth_error")
        worker = gateway.find(key)
        if worker is None:
            return _error(404, f"no worker {key!r}", "not_found")
        return JSONResponse(worker.describe(gateway.loads, gateway.clock()))

    @routes.delete("/workers/{key:path}")
    async def delete_worker(key: str, request: Request) -> Response:
        if (refused := refusal(request)) is not None:
            return refused
        worker = gateway.find(key)
        if worker is None:
            return _error(404, f"no worker {key!r}", "not_found")
        try:
            await gateway.remove_worker(worker.id)
        except RegistrationFailed as exc:  # gone from routing; only the index kept it
            log.warning("worker %s removed, but unregistering its pod failed: %r", worker.id, exc)
            return JSONResponse(
                {"removed": worker.id, "unregister_error": repr(exc)}, status_code=200
            )
        return JSONResponse({"removed": worker.id})

    return routes
