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
the engine reads it, in `gateway.requests.namespace`.

Bodies are read and written with orjson (several times faster than the standard library,
`docs/gateway-design.md`), falling back to the standard library for
what orjson would not keep exactly: integers beyond 64 bits (orjson reads them as floats),
NaN and Infinity (orjson writes them as null), nesting deeper than orjson writes. Only the
separators of the JSON sent upstream differ. A body nested too deeply for the standard
library (about 900 levels) is refused with 400; nothing is checked for it on the common
path. A string holding a lone surrogate (`"\\ud800"`: valid JSON, which orjson refuses)
is refused with 400 too: it is not Unicode text, so no tokenizer can encode it — here it
raised from the tokenizer, a 500 — and no engine can read it; only bodies orjson refused
are searched for one.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

import orjson

from globalkv.tokenize import NotTokenizable, Tokenizer

if array("I").itemsize != 4:
    raise ImportError("gateway.requests.bodies checks token ids with array('I'), 32-bit here")

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


_Constant = cast(Callable[[str], float], type("_Constant", (float,), {}))
"""NaN or ±Infinity as the client wrote it: orjson refuses to write a float subclass, so a
body holding one is written back by the standard library, which keeps it. Made by `type`
rather than a class statement: mypyc compiles no module that subclasses a builtin type,
and this one is on the compiled request path (docs/compiled.md)."""


_TOO_DEEP = "the request body is nested too deeply"


def decode_body(raw: bytes) -> object:
    """The JSON value of a request body; BadRequest when it is not JSON."""
    # find, not `in`: a bytes `in` first tries its operand as an int, raising and clearing
    # a TypeError each time (about 1,800 instructions, counted under callgrind).
    if raw.translate(_DIGITS).find(_LONG_NUMBER) < 0:
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


# Built per request: its own __init__, compiled where the module is (the dataclass gives
# eq and repr only; its generated __init__ runs interpreted): docs/gateway-design.md.
@dataclass(slots=True, init=False)
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
    model: str | None
    """The model the client named: workers that advertise it serve it."""

    def __init__(
        self,
        endpoint: Endpoint,
        body: dict[str, Any],
        stream: bool,
        batch: int | None,
        token_ids: list[int] | None,
        text: str | None,
        messages: list[dict[str, Any]] | None,
        model: str | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.body = body
        self.stream = stream
        self.batch = batch
        self.token_ids = token_ids
        self.text = text
        self.messages = messages
        self.model = model


# Built per request: its own __init__, compiled where the module is (the dataclass gives
# eq and repr only; its generated __init__ runs interpreted): docs/gateway-design.md.
@dataclass(slots=True, init=False)
class PromptTokens:
    tokens: list[int] | None
    text: str | None
    missing: str | None
    """Why there are no tokens: no_tokenizer or not_tokenizable."""

    def __init__(self, tokens: list[int] | None, text: str | None, missing: str | None) -> None:
        self.tokens = tokens
        self.text = text
        self.missing = missing


def _token_list(value: object, what: str) -> list[int]:
    """`value` when it is a non-empty list of token ids, checked in C (prompts are long).

    array("I") takes exactly the ints in [0, 2^32-1] (TypeError or OverflowError for
    anything else) but bools too, which are ints: they are looked for in the list written
    back as JSON, where only a bool has a letter (`true`, `false`). In C, that is 3x (64
    ids) to 6x (8,000) cheaper than comparing each element's type (`bench.gateway` prompts
    and long ones, timed with timeit).
    """
    if not isinstance(value, list) or not value:
        raise BadRequest(f"{what} must be a non-empty list of token ids")
    try:
        array("I", value)
    except (TypeError, OverflowError):
        raise BadRequest(f"{what} must hold integer token ids in [0, 2^32-1]") from None
    if orjson.dumps(value).find(b"e") >= 0:
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
