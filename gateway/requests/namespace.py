"""The KV-cache namespace a request's prompt lands in, derived as the engine will derive it.

An engine keys a prompt's blocks under its model, its LoRA adapter and its cache salt
(`globalkv.keys`: model ␟ LoRA name ␟ salt); the indexer reads the same three from the
engine's KV events. A lookup under any other namespace would count blocks the engine
cannot reuse for this request, or miss the ones it can. So the gateway reads the request
exactly as the engine reads it:

- vLLM: the OpenAI `model` names the adapter itself; the workers' `/v1/models` lists each
  adapter with `parent`, the base model it was loaded on. `cache_salt` in the body.
- SGLang: `model: "<base>:<adapter>"` (`_parse_model_parameter`: a served model's name
  followed by a colon), which wins over the body's `lora_path` (the adapter's name, in
  `/generate` and the OpenAI bodies); `cache_salt` in the body, an empty one being none.
  SGLang lists its adapters in `/v1/models` with `parent` too.
- SGLang's `extra_key` also namespaces the cache, but its KV events do not say which
  key a block was stored under, so no index can tell those blocks from the base model's:
  such a request is routed by load (`opaque`).

An adapter no worker lists is refused (`UnknownAdapter`, a 404 like an unknown model's):
no engine would serve it. A batch is routed by its first element, as everywhere in the
gateway; every adapter it names must be served by the pods chosen.

This is the one place a request's namespace is derived: the gateway's inference handler
and any other entry point (an endpoint picker, a sidecar) call `request_namespace`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.requests.bodies import BadRequest
from gateway.settings.base import Kind

MAX_NAME_CHARS = 256
"""Longest adapter name or salt read; vLLM allows a salt of 128 characters."""


class UnknownAdapter(LookupError):
    """The request names a LoRA adapter no worker serves; the message says which."""


@dataclass(frozen=True, slots=True)
class RequestNamespace:
    model: str | None
    """The base model the request is for: the adapter's parent, else the model it names."""
    lora_name: str | None = None
    cache_salt: str | None = None
    adapters: frozenset[str] = field(default_factory=frozenset)
    """Every adapter the request names (a batch may name several): its pods serve all."""
    kind: Kind | None = None
    """The engine whose naming the adapter came in (another engine would serve the base
    model for the same body), or None when any engine reads the request alike."""
    opaque: bool = False
    """The engine adds what its KV events do not tell (SGLang's `extra_key`): no lookup."""


BASE = RequestNamespace(None)


@dataclass(frozen=True, slots=True)
class ServedAdapter:
    """A LoRA adapter a worker serves: the worker's `/v1/models` lists it with `parent`."""

    name: str
    base: str
    """The base model it was loaded on: adapters of one name may serve several models."""
    kind: Kind
    """The engine of the worker serving it, whose naming a request must use."""


def request_namespace(
    body: Mapping[str, Any], adapters: Collection[ServedAdapter], models: Collection[str]
) -> RequestNamespace:
    """The namespace of a request `body`, given the LoRA `adapters` the workers serve and
    the base `models` they serve.

    Raises `UnknownAdapter` for an adapter no worker of the engine whose naming the body
    uses serves, and `BadRequest` for a salt, adapter or extra key that is not a string
    (or a list of them, for a batch).
    """
    named = body.get("model")
    model = named if isinstance(named, str) else None
    if not adapters and (model is None or ":" not in model) and _NAMESPACE_FIELDS.isdisjoint(body):
        # The common request, read per request: nothing in it can name an adapter or a salt.
        return BASE if model is None else _of_model(model)
    salt = _first(body.get("cache_salt"), "cache_salt") or None
    opaque = bool(_first(body.get("extra_key"), "extra_key"))
    paths = _strings(body.get("lora_path"), "lora_path")
    from_model = _sglang_adapter(model, {a.name for a in adapters}, models)
    if from_model is not None:
        base, adapter = from_model
        if adapter:
            return _served(base, [adapter], salt, opaque, adapters)
        model = base
    if paths:
        bases = _bases(adapters, paths[0], "sglang")
        parent = model if model in bases else bases[0] if bases else None
        return _served(parent, paths, salt, opaque, adapters)
    bases = _bases(adapters, model, "vllm")
    if model is not None and bases and model not in models:
        return RequestNamespace(bases[0], model, salt, frozenset([model]), "vllm", opaque)
    if salt is None and not opaque and model is None:
        return BASE
    return RequestNamespace(model, None, salt, opaque=opaque)


_NAMESPACE_FIELDS = frozenset({"cache_salt", "extra_key", "lora_path"})
"""The body's fields besides `model` that `request_namespace` reads."""

_MODELS_KEPT = 64
_OF_MODEL: dict[str, RequestNamespace] = {}
"""The namespace of a request that names only its model, by model: every chat completion
names one, and building the frozen namespace cost 0.7 µs against a lookup's 0.02 (timeit).
At most `_MODELS_KEPT`, since the client writes the name."""


def _of_model(model: str) -> RequestNamespace:
    namespace = _OF_MODEL.get(model)
    if namespace is None:
        namespace = RequestNamespace(model)
        if len(_OF_MODEL) < _MODELS_KEPT:
            _OF_MODEL[model] = namespace
    return namespace


def _bases(adapters: Collection[ServedAdapter], name: str | None, kind: Kind) -> list[str]:
    return sorted({a.base for a in adapters if a.name == name and a.kind == kind})


def _served(
    base: str | None,
    named: list[str],
    salt: str | None,
    opaque: bool,
    adapters: Collection[ServedAdapter],
) -> RequestNamespace:
    """SGLang's naming: every adapter named must be served by an SGLang worker of `base`."""
    for name in named:
        if base is None or ServedAdapter(name, base, "sglang") not in adapters:
            of = "" if base is None else f" of {base!r}"
            raise UnknownAdapter(
                f"no SGLang worker{of} serves the LoRA adapter {name!r} (workers list their "
                "adapters in /v1/models)"
            )
    return RequestNamespace(base, named[0], salt, frozenset(named), "sglang", opaque)


def _sglang_adapter(
    model: str | None, names: Collection[str], models: Collection[str]
) -> tuple[str, str] | None:
    """SGLang's `<base>:<adapter>`: a served model's name, a colon, an adapter's name. A
    model that is itself served (names may hold colons) names no adapter."""
    if model is None or ":" not in model or model in models or model in names:
        return None
    for base in models:
        if model.startswith(f"{base}:"):
            return base, model[len(base) + 1 :].strip()
    base, _, adapter = model.partition(":")
    return (base.strip(), adapter.strip()) if base.strip() in models else None


def _first(value: object, name: str) -> str | None:
    strings = _strings(value, name)
    return strings[0] if strings else None


def _strings(value: object, name: str) -> list[str]:
    """A string or a batch's list of them (None and empty ones dropped), each bounded."""
    if value is None:
        return []
    values: list[object] = value if isinstance(value, list) else [value]
    strings = [v for v in values if isinstance(v, str) and v]
    if any(v is not None and not isinstance(v, str) for v in values):
        raise BadRequest(f"'{name}' must be a string or a list of strings")
    if any(len(v) > MAX_NAME_CHARS for v in strings):
        raise BadRequest(f"'{name}' must be at most {MAX_NAME_CHARS} characters")
    return strings
