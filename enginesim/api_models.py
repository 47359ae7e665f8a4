"""Request bodies of the SGLang and OpenAI endpoints, validated, and their prompts.

Bodies are pydantic models (unknown fields ignored, as the engines ignore what they do not
use) so a malformed body is a 422 naming the field. `prompts()` then expands a body into
one `Prompt` per element — batch entries times `n` samples — and applies SGLang's rules
for the PD fields (`_normalize_bootstrap_params`): a scalar host or port serves every
element, a scalar room becomes `room + i`, a list must have one entry per element. Rooms
must lie in [1, 2^63 - 1]: 0 is the decode's "not written" marker (PROTOCOLS §2).

`cache_namespace()` reads a body's LoRA adapter and cache salt as the emulated engine
reads them: vLLM takes an adapter's name as the `model` and checks the salt as its
`validate_cache_salt` does; SGLang takes `model: "base:adapter"` (which wins) or
`lora_path`, and an empty salt as none. One request is one namespace here: a batch whose
elements name different adapters or salts is refused.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from enginesim.engine import Api, Bootstrap, Prompt
from enginesim.handshake import MAX_ROOM
from enginesim.kvcache import CacheNamespace
from globalkv.tokenize import Tokenizer

MAX_PROMPT_TOKENS = 1 << 20
MAX_ELEMENTS = 1024
MAX_NEW_TOKENS = 1 << 16
MAX_SALT_CHARS = 128
_SALT_FORBIDDEN = frozenset("@/\\\0")
MAX_BODY_BYTES = 64 << 20
"""Largest request body read: a prompt of MAX_PROMPT_TOKENS ids is about 8 MB of JSON."""

Host = Annotated[
    str, Field(min_length=1, max_length=253, pattern=r"^(\[?[0-9A-Fa-f:.]+\]?|[A-Za-z0-9._-]+)$")
]
"""A host name or an IP address, nothing that could reshape the decode's bootstrap URL."""
TokenId = Annotated[int, Field(ge=0, le=2**32 - 1)]
TokenList = Annotated[list[TokenId], Field(max_length=MAX_PROMPT_TOKENS)]
Room = Annotated[int, Field(ge=1, le=MAX_ROOM)]
Port = Annotated[int, Field(ge=1, le=65535)]
DPRank = Annotated[int, Field(ge=0, le=1023)]
NewTokens = Annotated[int, Field(ge=0, le=MAX_NEW_TOKENS)]
Elements = Annotated[int, Field(ge=1, le=64)]


class BadRequest(ValueError):
    """A body that validates field by field but not as a whole; answered with 400."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class KVTransferParams(_Body):
    """vLLM's NIXL-connector fields: a prefill asked to keep the KV for a remote decode, or
    a decode told where to pull it from."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = Field(None, max_length=256)
    remote_request_id: str | None = Field(None, min_length=1, max_length=256)
    remote_block_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, max_length=MAX_PROMPT_TOKENS
    )
    remote_host: Host | None = None
    remote_port: Annotated[int, Field(ge=1, le=65535)] | None = None
    tp_size: Annotated[int, Field(ge=1, le=64)] | None = None


class PDFields(_Body):
    bootstrap_host: Host | list[Host] | None = None
    bootstrap_port: Port | list[Port | None] | None = None
    bootstrap_room: Room | list[Room] | None = None
    routed_dp_rank: DPRank | None = None
    disagg_prefill_dp_rank: DPRank | None = None
    kv_transfer_params: KVTransferParams | None = None


class SamplingParams(_Body):
    max_new_tokens: NewTokens | None = None


class TenantFields(_Body):
    """The fields that put a request's KV in a namespace of its own."""

    lora_path: str | list[str | None] | None = None
    cache_salt: str | list[str] | None = None


class GenerateRequest(PDFields, TenantFields):
    text: str | list[str] | None = None
    input_ids: TokenList | list[TokenList] | None = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    stream: bool = False
    rid: str | list[str] | None = None


class StreamOptions(_Body):
    include_usage: bool = False


class CompletionRequest(PDFields, TenantFields):
    model: str | None = None
    prompt: str | list[str] | TokenList | list[TokenList]
    max_tokens: NewTokens = 16
    n: Elements = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    rid: str | None = None


class ChatRequest(PDFields, TenantFields):
    model: str | None = None
    messages: Annotated[list[dict[str, Any]], Field(min_length=1, max_length=4096)]
    max_tokens: NewTokens | None = None
    max_completion_tokens: NewTokens | None = None
    n: Elements = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    rid: str | None = None


def _per_element(value: Any, count: int, name: str) -> list[Any]:
    if not isinstance(value, list):
        return [value] * count
    if len(value) != count:
        raise BadRequest(f"{name} has {len(value)} entries for {count} prompts")
    return value


def _rooms(value: int | list[int] | None, count: int) -> list[int | None]:
    if value is None:
        return [None] * count
    if isinstance(value, int):
        if value + count - 1 > MAX_ROOM:
            raise BadRequest(f"bootstrap_room {value} + {count - 1} exceeds 2^63 - 1")
        return [value + i for i in range(count)]
    return list(_per_element(value, count, "bootstrap_room"))


def _bootstraps(fields: PDFields, count: int) -> list[Bootstrap | None]:
    hosts = _per_element(fields.bootstrap_host, count, "bootstrap_host")
    ports = _per_element(fields.bootstrap_port, count, "bootstrap_port")
    rooms = _rooms(fields.bootstrap_room, count)
    out: list[Bootstrap | None] = []
    for host, port, room in zip(hosts, ports, rooms, strict=True):
        if host is None and room is None:
            out.append(None)
        elif host is None or room is None:
            raise BadRequest("bootstrap_host and bootstrap_room must be given together")
        else:
            out.append(Bootstrap(host=host, port=port, room=room))
    return out


def _build(
    token_lists: Sequence[list[int]],
    max_new: Sequence[int],
    fields: PDFields,
    rids: Sequence[str | None],
) -> list[Prompt]:
    if not token_lists:
        raise BadRequest("the request holds no prompt")
    if len(token_lists) > MAX_ELEMENTS:
        raise BadRequest(f"{len(token_lists)} prompts in one request; the limit is {MAX_ELEMENTS}")
    for ids in token_lists:
        if not ids:
            raise BadRequest("a prompt must have at least one token")
        if len(ids) > MAX_PROMPT_TOKENS:
            raise BadRequest(f"a prompt of {len(ids)} tokens exceeds {MAX_PROMPT_TOKENS}")
    bootstraps = _bootstraps(fields, len(token_lists))
    params = fields.kv_transfer_params
    transfer = None if params is None else params.model_dump()
    return [
        Prompt(
            rid=rid or uuid.uuid4().hex,
            input_ids=ids,
            max_new_tokens=new,
            bootstrap=bootstrap,
            routed_dp_rank=fields.routed_dp_rank,
            disagg_prefill_dp_rank=fields.disagg_prefill_dp_rank,
            kv_transfer=transfer,
        )
        for ids, new, bootstrap, rid in zip(token_lists, max_new, bootstraps, rids, strict=True)
    ]


def _split(items: Sequence[Any]) -> tuple[list[list[int]], list[str], bool]:
    """A validated prompt field (all ids, all texts or all id lists) as token lists, texts,
    and whether it was a list of prompts."""
    lists = [item for item in items if isinstance(item, list)]
    texts = [item for item in items if isinstance(item, str)]
    if lists or texts:
        return lists, texts, True
    return [list(items)], [], False


def _sample_rids(rid: str | None, count: int) -> list[str | None]:
    if rid is None or count == 1:
        return [rid] * count
    return [f"{rid}-{i}" for i in range(count)]


def generate_prompts(body: GenerateRequest, tokenizer: Tokenizer, default_new: int) -> list[Prompt]:
    if (body.text is None) == (body.input_ids is None):
        raise BadRequest("give exactly one of text and input_ids")
    if body.input_ids is not None:
        token_lists, _, batch = _split(body.input_ids)
    elif isinstance(body.text, list):
        token_lists, batch = [tokenizer.encode(text) for text in body.text], True
    else:
        token_lists, batch = [tokenizer.encode(body.text or "")], False
    count = len(token_lists)
    sampling = SamplingParams() if body.sampling_params is None else body.sampling_params
    params = _per_element(sampling, count, "sampling_params")
    max_new = [p.max_new_tokens if p.max_new_tokens is not None else default_new for p in params]
    rids = _per_element(body.rid, count, "rid")
    if not batch and isinstance(body.bootstrap_room, list):
        raise BadRequest("bootstrap_room is a list but the request is not a batch")
    return _build(token_lists, max_new, body, rids)


def completion_prompts(body: CompletionRequest, tokenizer: Tokenizer) -> list[Prompt]:
    if isinstance(body.prompt, str):
        token_lists = [tokenizer.encode(body.prompt)]
    else:
        token_lists, texts, _ = _split(body.prompt)
        if texts:
            token_lists = [tokenizer.encode(text) for text in texts]
    samples = [ids for ids in token_lists for _ in range(body.n)]
    count = len(samples)
    return _build(samples, [body.max_tokens] * count, body, _sample_rids(body.rid, count))


def chat_prompts(body: ChatRequest, tokenizer: Tokenizer, default_new: int) -> list[Prompt]:
    messages: Sequence[Mapping[str, Any]] = body.messages
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    new = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
    max_new = default_new if new is None else new
    return _build([ids] * body.n, [max_new] * body.n, body, _sample_rids(body.rid, body.n))


def cache_namespace(
    body: TenantFields, model: str | None, api: Api, served: str, adapters: Sequence[str]
) -> CacheNamespace:
    """The namespace `body` (naming `model`) is cached under on an engine serving `served`
    with `adapters`; raises BadRequest as the engine refuses."""
    salt = _one(body.cache_salt, "cache_salt")
    if api == "vllm":
        adapter = model if model in adapters else None
        if salt is not None and (
            not salt or len(salt) > MAX_SALT_CHARS or _SALT_FORBIDDEN.intersection(salt)
        ):
            raise BadRequest(
                "Parameter 'cache_salt' must be a non-empty string of at most 128 characters "
                "without '@', '/', '\\' or NUL."
            )
    else:
        adapter = _sglang_adapter(model, served) or _one(body.lora_path, "lora_path")
        if adapter is not None and adapter not in adapters:
            raise BadRequest(f"The LoRA adapter {adapter!r} is not loaded.")
        salt = salt or None
    if adapter is None and salt is None:
        return CacheNamespace()
    lora_id = None if adapter is None else adapters.index(adapter) + 1
    return CacheNamespace(adapter, lora_id, salt)


def _sglang_adapter(model: str | None, served: str) -> str | None:
    """SGLang's `model: "base:adapter"` (`_parse_model_parameter`)."""
    if model is None or ":" not in model or model == served:
        return None
    adapter = model[len(served) + 1 :] if model.startswith(f"{served}:") else model.split(":", 1)[1]
    return adapter.strip() or None


def _one(value: str | list[Any] | None, name: str) -> Any:
    if not isinstance(value, list):
        return value
    if len(set(value)) > 1:
        raise BadRequest(f"every element of one request must have the same {name}")
    return value[0] if value else None
