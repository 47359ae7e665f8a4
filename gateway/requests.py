"""Inference request bodies: validated just enough to route, everything else passed on.

The gateway does not own the engines' schemas, so it checks only the fields it reads
(prompt, messages, ids, `n`, `stream`) and keeps the rest untouched. A body it cannot
route answers 400 with the reason, before anything is sent upstream.

The prompt's tokens come from the request (`input_ids`, a token-list `prompt`) or from
the configured tokenizer (`text`, a string `prompt`, chat `messages`). A batch is routed
as one unit by its first element, and holds at most `MAX_BATCH` elements: each gets its
own room, so a chat asking for `n` = 10 million would otherwise have the gateway draw and
send 10 million rooms.

A request's KV-cache namespace (model, LoRA adapter, cache salt) is read from its body as
the engine reads it (`request_namespace`, below).

Bodies are read and written with orjson (several times faster than the standard library,
`docs/gateway-design.md`), falling back to the standard library for
what orjson would not keep exactly: integers beyond 64 bits (orjson reads them as floats),
NaN and Infinity (orjson writes them as null), nesting deeper than orjson writes. Only the
separators of the JSON sent upstream differ. A body nested too deeply for the standard
library (about 900 levels) is refused with 400; nothing is checked for it on the common
path. A string holding a lone surrogate (`"\ud800"`: valid JSON, which orjson refuses)
is refused with 400 too: it is not Unicode text, so no tokenizer can encode it — here it
raised from the tokenizer, a 500 — and no engine can read it; only bodies orjson refused
are searched for one.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from gateway.settings.base import Kind
from globalkv.tokenize import NotTokenizable, Tokenizer

if array("I").itemsize != 4:
    raise ImportError("gateway.requests checks token ids with array('I'), 32-bit here")

Endpoint = Literal["generate", "completions", "chat"]
MAX_BATCH = 4096
_DIGITS = bytes.maketrans(b"123456789", b"000000000")
_LONG_NUMBER = b"0" * 20
"""Twenty digits in a row: maybe an integer beyond 64 bits."""


def _is_token_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) for t in value)


def batch_size(endpoint: Endpoint, body: Mapping[str, Any]) -> int | None:
    """Elements of a batch request, or None for a single request: `/generate` with a list
    `text` or a list of `input_ids` lists, `/v1/completions` with a list of strings or of
    token lists, a chat with `n > 1`."""
    if endpoint == "generate":
        text, ids = body.get("text"), body.get("input_ids")
        if isinstance(text, list):
            return len(text)
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            return len(ids)
        return None
    if endpoint == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not _is_token_list(prompt):
            return len(prompt)
        return None
    n = body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else None


class BadRequest(ValueError):
    """The body cannot be routed; the message is what the client reads."""


class _Constant(float):
    """NaN or ±Infinity as the client wrote it: orjson refuses to write a float subclass,
    so a body holding one is written back by the standard library, which keeps it."""


_TOO_DEEP = "the request body is nested too deeply"


def decode_body(raw: bytes) -> object:
    """The JSON value of a request body; BadRequest when it is not JSON."""
    if _LONG_NUMBER not in raw.translate(_DIGITS):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    try:
        value = json.loads(raw, parse_constant=_Constant)
    except RecursionError:
        raise BadRequest(_TOO_DEEP) from None
    except ValueError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    where = _lone_surrogate(value)
    if where is not None:
        raise BadRequest(
            f"the request body holds a lone surrogate (a \\ud800-\\udfff escape without "
            f"its pair) at {where}: it is valid JSON but not text, and cannot be tokenized"
        )
    return value


def _lone_surrogate(value: object) -> str | None:
    """Where the first string (value or key) holding a lone surrogate is, or None."""
    pending: list[tuple[str, object]] = [("the top level", value)]
    while pending:
        where, item = pending.pop()
        if isinstance(item, str):
            try:
                item.encode()
            except UnicodeEncodeError:
                return where
        elif isinstance(item, dict):
            for key, inner in item.items():
                pending += [(f"a key of {where}", key), (_field(where, repr(key)), inner)]
        elif isinstance(item, list):
            pending += [(_field(where, str(i)), inner) for i, inner in enumerate(item)]
    return None


def _field(where: str, key: str) -> str:
    return f"[{key}]" if where == "the top level" else f"{where}[{key}]"


def encode_body(body: object) -> bytes:
    """`body` as JSON; BadRequest when it is nested too deeply to write."""
    try:
        return orjson.dumps(body)
    except TypeError:
        try:
            return json.dumps(body).encode()
        except RecursionError:
            raise BadRequest(_TOO_DEEP) from None


# ---------------------------------------------------------------- namespaces
# The KV-cache namespace a request's prompt lands in, derived as the engine will derive it.
#
# An engine keys a prompt's blocks under its model, its LoRA adapter and its cache salt
# (`globalkv.keys`: model ␟ LoRA name ␟ salt); the indexer reads the same three from the
# engine's KV events. A lookup under any other namespace would count blocks the engine
# cannot reuse for this request, or miss the ones it can. So the gateway reads the request
# exactly as the engine reads it:
#
# - vLLM: the OpenAI `model` names the adapter itself; the workers' `/v1/models` lists each
#   adapter with `parent`, the base model it was loaded on. `cache_salt` in the body.
# - SGLang: `model: "<base>:<adapter>"` (`_parse_model_parameter`: a served model's name
#   followed by a colon), which wins over the body's `lora_path` (the adapter's name, in
#   `/generate` and the OpenAI bodies); `cache_salt` in the body, an empty one being none.
#   SGLang lists its adapters in `/v1/models` with `parent` too.
# - SGLang's `extra_key` also namespaces the cache, but its KV events do not say which
#   key a block was stored under, so no index can tell those blocks from the base model's:
#   such a request is routed by load (`opaque`).
#
# An adapter no worker lists is refused (`UnknownAdapter`, a 404 like an unknown model's):
# no engine would serve it. A batch is routed by its first element, as everywhere in the
# gateway; every adapter it names must be served by the pods chosen.
#
# This is the one place a request's namespace is derived: the gateway's inference handler
# and any other entry point (an endpoint picker, a sidecar) call `request_namespace`.

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
        return BASE if model is None else RequestNamespace(model)
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


@dataclass(slots=True)
class ParsedRequest:
    endpoint: Endpoint
    body: dict[str, Any]
    stream: bool
    batch: int | None
    """Elements when the body is a batch; None for a single request."""
    token_ids: list[int] | None
    """Tokens the client gave (first element of a batch)."""
    text: str | None
    """Plain text to tokenize (first element of a batch)."""
    messages: list[dict[str, Any]] | None
    model: str | None = None
    """The model the client named: workers that advertise it serve it."""
    namespace: RequestNamespace = field(default_factory=lambda: BASE)
    """Where its prompt's KV is cached (`request_namespace`), once the handler read it."""
    request_id: str | None = None
    """The client's request id (`gateway.edge`), sent on to the workers."""


@dataclass(slots=True)
class PromptTokens:
    tokens: list[int] | None
    text: str | None
    missing: str | None
    """Why there are no tokens: no_tokenizer or not_tokenizable."""


def _token_list(value: object, what: str) -> list[int]:
    """`value` when it is a non-empty list of token ids, checked in C (prompts are long).

    array("I") takes exactly the ints in [0, 2^32-1] (TypeError or OverflowError for
    anything else) but bools too, which are ints: they are looked for separately.
    """
    if not isinstance(value, list) or not value:
        raise BadRequest(f"{what} must be a non-empty list of token ids")
    try:
        array("I", value)
    except (TypeError, OverflowError):
        raise BadRequest(f"{what} must hold integer token ids in [0, 2^32-1]") from None
    if bool in map(type, value):
        raise BadRequest(f"{what} must hold integer token ids in [0, 2^32-1]")
    return value


def _first_of_batch(value: list[Any], what: str) -> Any:
    if not value:
        raise BadRequest(f"{what} must not be an empty list")
    return value[0]


def _prompt(endpoint: Endpoint, body: Mapping[str, Any]) -> tuple[list[int] | None, str | None]:
    if endpoint == "generate":
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise BadRequest("give exactly one of 'text' or 'input_ids'")
        if ids is not None:
            if isinstance(ids, list) and ids and isinstance(ids[0], list):
                for element in ids:
                    _token_list(element, "each 'input_ids' element")
                return ids[0], None
            return _token_list(ids, "'input_ids'"), None
        if isinstance(text, list):
            if not all(isinstance(t, str) for t in text):
                raise BadRequest("'text' must be a string or a list of strings")
            return None, _first_of_batch(text, "'text'")
        if not isinstance(text, str):
            raise BadRequest("'text' must be a string or a list of strings")
        return None, text
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return None, prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return None, prompt[0]
        if all(isinstance(p, list) for p in prompt):
            for element in prompt:
                _token_list(element, "each 'prompt' element")
            return prompt[0], None
        return _token_list(prompt, "'prompt'"), None
    raise BadRequest(
        "'prompt' must be a string, a list of strings, a list of token ids or a list of those"
    )


def parse_request(endpoint: Endpoint, body: object) -> ParsedRequest:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean")
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise BadRequest("'n' must be a positive integer")
    token_ids: list[int] | None = None
    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    if endpoint == "chat":
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw or not all(isinstance(m, dict) for m in raw):
            raise BadRequest("'messages' must be a non-empty list of objects")
        messages = raw
    else:
        token_ids, text = _prompt(endpoint, body)
    batch = batch_size(endpoint, body)
    if batch is not None and batch > MAX_BATCH:
        message = f"a batch holds at most {MAX_BATCH} elements ('n' or the list), not {batch}"
        raise BadRequest(message)
    model = body.get("model")
    return ParsedRequest(
        endpoint,
        body,
        stream,
        batch,
        token_ids,
        text,
        messages,
        model if isinstance(model, str) else None,
    )


def _chat_text(messages: list[dict[str, Any]]) -> str:
    """The conversation's text, cache_aware's key when it cannot be tokenized."""
    parts: list[str] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(
                p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
            )
    return "\n".join(parts)


def prompt_tokens(request: ParsedRequest, tokenizer: Tokenizer | None) -> PromptTokens:
    """The prompt's ids as the engine will compute them, or why they are unknown.

    Raises `globalkv.tokenize.TokenizeError` (a ValueError) for messages the chat template
    refuses: the engine would refuse them too.
    """
    if request.token_ids is not None:
        return PromptTokens(request.token_ids, None, None)
    text = request.text if request.messages is None else _chat_text(request.messages)
    if tokenizer is None:
        return PromptTokens(None, text, "no_tokenizer")
    try:
        if request.messages is not None:
            return PromptTokens(tokenizer.apply_chat_template(request.messages), text, None)
        assert request.text is not None
        return PromptTokens(tokenizer.encode(request.text), text, None)
    except NotTokenizable:
        return PromptTokens(None, text, "not_tokenizable")
