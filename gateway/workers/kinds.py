"""Which PD protocol a worker speaks, asked of the worker itself.

In the order smg asks: `GET /v1/models` (both engines answer it; `owned_by` is "vllm" or
"sglang", and the first model's id is the served model), then `GET /server_info` (SGLang's:
a JSON object with its server arguments), then `GET /version` (vLLM's: `{"version": …}`).
A worker that tells none of these is left undetected: the gateway treats it as SGLang,
the protocol every worker spoke before vLLM's existed here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from gateway.settings.base import Kind

_SGLANG_KEYS = frozenset(
    {"disaggregation_mode", "disaggregation_bootstrap_port", "tp_size", "kv_events"}
)
_OWNERS: dict[str, Kind] = {"vllm": "vllm", "sglang": "sglang"}


@dataclass(frozen=True, slots=True)
class Detected:
    kind: Kind | None
    """None: the worker told nothing."""
    model: str | None
    how: str
    """Which answer told it, for the log and `/workers`."""


async def _json(client: httpx.AsyncClient, url: str, timeout: float) -> Any:
    try:
        response = await client.get(url, timeout=timeout)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        return response.json()
    except ValueError:
        return None


def _from_models(body: object) -> tuple[Kind | None, str | None]:
    if not isinstance(body, Mapping) or not isinstance(body.get("data"), list):
        return None, None
    first = next((m for m in body["data"] if isinstance(m, Mapping)), None)
    if first is None:
        return None, None
    owner, model = first.get("owned_by"), first.get("id")
    kind = _OWNERS.get(owner.lower()) if isinstance(owner, str) else None
    return kind, model if isinstance(model, str) else None


MAX_ADAPTERS = 4096
"""Adapters read from one worker's `/v1/models`; more are ignored."""


def served_adapters(body: object) -> dict[str, str]:
    """The LoRA adapters a `/v1/models` answer lists, name → base model: the cards whose
    `parent` names another model (vLLM and SGLang list adapters so, the base with none)."""
    if not isinstance(body, Mapping) or not isinstance(body.get("data"), list):
        return {}
    adapters: dict[str, str] = {}
    for card in body["data"][:MAX_ADAPTERS]:
        if not isinstance(card, Mapping):
            continue
        name, parent = card.get("id"), card.get("parent")
        if isinstance(name, str) and isinstance(parent, str) and name and parent != name:
            adapters[name] = parent
    return adapters


async def read_adapters(
    client: httpx.AsyncClient, url: str, timeout: float
) -> dict[str, str] | None:
    """The worker's adapters; None when it did not answer `/v1/models` with JSON."""
    body = await _json(client, url + "/v1/models", timeout)
    return None if body is None else served_adapters(body)


async def detect_kind(client: httpx.AsyncClient, url: str, timeout: float) -> Detected:
    """The worker's kind and served model, as far as its answers tell; never raises."""
    kind, model = _from_models(await _json(client, url + "/v1/models", timeout))
    if kind is not None:
        return Detected(kind, model, "/v1/models owned_by")
    info = await _json(client, url + "/server_info", timeout)
    if isinstance(info, Mapping) and _SGLANG_KEYS & info.keys():
        return Detected("sglang", model, "/server_info")
    version = await _json(client, url + "/version", timeout)
    if isinstance(version, Mapping) and isinstance(version.get("version"), str):
        return Detected("vllm", model, "/version")
    return Detected(None, model, "nothing")
