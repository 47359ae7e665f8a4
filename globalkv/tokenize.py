"""Prompt tokens computed exactly as the engine computes them.

The gateway keys a prompt's blocks to look them up in the index, and the engine keys the
same blocks from the tokens it actually prefilled; a single differing id (a BOS added on
one side only, a special token split into pieces) and every lookup misses. So both sides
share this module:

- `encode(text)` is the engine's plain-text path (`/generate` `text`, a string `prompt`):
  the tokenizer's own post-processor runs, so a BOS is added when the model adds one.
- `apply_chat_template(messages)` is the engine's chat path, done the way Hugging Face
  transformers does it: the template is rendered with jinja2 in a sandbox
  (`trim_blocks`, `lstrip_blocks`, `loopcontrols`, transformers' `tojson`,
  `raise_exception`, `strftime_now`, the `{% generation %}` tag) with the special tokens
  (`bos_token`, `eos_token`, …) as variables, then encoded *without* adding special
  tokens, because the template already wrote them.
- Special tokens written in text (`<|im_start|>`) become their single ids in both paths,
  as in the engines (tokenizers' added-token matching).

`ByteTokenizer` is a self-contained stand-in for the emulated stack: one id per UTF-8
byte, two special ids and a fixed chat format.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFCoreTokenizer

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "NotTokenizable",
    "TokenizeError",
    "Tokenizer",
    "load_tokenizer",
]


class TokenizeError(ValueError):
    """The input cannot be tokenized (a template refused the messages, a bad message shape).

    A `ValueError`, so HTTP layers answer 400 with its message.
    """


@runtime_checkable
class Tokenizer(Protocol):
    name: str
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text, special tokens added as the model's own encoder does."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of generated ids, special tokens skipped (what engines return)."""
        ...

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of an OpenAI-style chat, as the engine's chat endpoint computes them."""
        ...


class NotTokenizable(RuntimeError):
    """Valid input whose engine ids cannot be reproduced here (images, no chat template).

    Not the client's fault: the gateway routes such a request by load instead.
    """


_TEXT_PARTS = ("text", "input_text")


def normalize_messages(
    messages: Sequence[Mapping[str, Any]], *, content_as_parts: bool
) -> list[dict[str, Any]]:
    """Messages shaped the way SGLang hands them to a chat template.

    Keys whose value is null are dropped. A content list becomes one string of its text
    parts joined by a space for templates that print `content`, or stays a list of
    `{"type": "text", "text": …}` parts for templates that iterate over it. Parts other
    than text (images, audio) raise `NotTokenizable`: the engine inserts media tokens the
    gateway cannot know.
    """
    shaped: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TokenizeError(f"a chat message must be an object, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise TokenizeError("a chat message needs a non-empty string 'role'")
        out = {str(k): v for k, v in message.items() if v is not None}
        content = message.get("content")
        if isinstance(content, list):
            texts: list[str] = []
            for part in content:
                if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                    raise TokenizeError("a content part must be an object with a string 'type'")
                if part["type"] not in _TEXT_PARTS:
                    raise NotTokenizable(f"content parts of type {part['type']!r}")
                text = part.get("text")
                if not isinstance(text, str):
                    raise TokenizeError("a text content part needs a string 'text'")
                texts.append(text)
            out["content"] = (
                [{"type": "text", "text": t} for t in texts]
                if content_as_parts
                else " ".join(texts)
            )
        elif content is not None and not isinstance(content, str):
            raise TokenizeError("message 'content' must be a string, a list of parts or null")
        shaped.append(out)
    return shaped


class ByteTokenizer:
    """One id per UTF-8 byte (0–255), BOS 256, EOS 257; no vocabulary file needed.

    Chat format, per message `<|role|>\\n` + content + `<|end|>\\n`, then `<|assistant|>\\n`
    as the generation prompt; the markers are plain bytes, so only BOS is special. Prompts
    start with BOS in both paths, like most real models.
    """

    BOS = 256
    EOS = 257

    def __init__(self) -> None:
        self.name = "byte"
        self.eos_token_id: int | None = self.EOS

    def encode(self, text: str) -> list[int]:
        return [self.BOS, *text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        parts = [
            f"<|{m['role']}|>\n{m.get('content', '')}<|end|>\n"
            for m in normalize_messages(messages, content_as_parts=False)
        ]
        if add_generation_prompt:
            parts.append("<|assistant|>\n")
        return [self.BOS, *"".join(parts).encode("utf-8")]


_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _token_content(value: object) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` as transformers renders it: just the body.

    (transformers also records assistant-token masks there, which routing does not need.)
    """

    tags = {"generation"}  # noqa: RUF012 - jinja2's Extension API declares it this way

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """The template compiled with transformers' environment, so it renders identically."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(f"chat template does not compile: {exc}") from exc


_MEDIA_WORDS = ("image", "audio", "video", "vision")


def _subject(node: jinja2.nodes.Node) -> jinja2.nodes.Node:
    """What a loop iterates over, under filters, tests and slices."""
    while True:
        filtered = isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test)
        sliced = isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice)
        inner = getattr(node, "node", None)
        if not (filtered or sliced) or inner is None:
            return node
        node = inner


def _is_content_of_message(node: jinja2.nodes.Node) -> bool:
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const):
        base, key = node.node, node.arg.value
    elif isinstance(node, jinja2.nodes.Getattr):
        base, key = node.node, node.attr
    else:
        return False
    return (
        key == "content"
        and isinstance(base, jinja2.nodes.Name)
        and base.name in ("message", "msg", "m")
    )


def template_takes_content_parts(template: jinja2.Template, source: str) -> bool:
    """SGLang's content-format detection: does the template iterate over `content`?

    True for templates naming media or looping over `message['content']` (also
    `msg.content`, `m.content`): they get parts; all others get one string.
    """
    if any(word in source for word in _MEDIA_WORDS):
        return True
    tree = template.environment.parse(source)
    return any(
        _is_content_of_message(_subject(loop.iter)) for loop in tree.find_all(jinja2.nodes.For)
    )


def _select_template(raw: object, source: Path) -> str | None:
    """tokenizer_config.json's chat_template: one string, or named ones (use `default`)."""
    if raw is None or isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        named = {
            t.get("name"): t.get("template")
            for t in raw
            if isinstance(t, Mapping) and isinstance(t.get("template"), str)
        }
        chosen = named.get("default")
        if chosen is None:
            raise ValueError(f"{source}: chat_template list has no 'default' entry")
        return str(chosen)
    raise ValueError(f"{source}: chat_template must be a string or a list of named templates")


class HFTokenizer:
    """A Hugging Face `tokenizer.json` with the model's chat template."""

    def __init__(
        self,
        core: _HFCoreTokenizer,
        *,
        name: str,
        special_tokens: Mapping[str, str] | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.name = name
        self._core = core
        self._special = dict(special_tokens or {})
        self._template = compile_chat_template(chat_template) if chat_template else None
        self._content_as_parts = self._template is not None and template_takes_content_parts(
            self._template, chat_template or ""
        )
        eos = self._special.get("eos_token")
        self.eos_token_id: int | None = core.token_to_id(eos) if eos is not None else None

    @classmethod
    def from_path(cls, path: str | Path) -> HFTokenizer:
        """A model directory (tokenizer.json + tokenizer_config.json) or a tokenizer.json."""
        target = Path(path)
        directory = target if target.is_dir() else target.parent
        tokenizer_file = target / "tokenizer.json" if target.is_dir() else target
        if not tokenizer_file.is_file():
            raise ValueError(f"no tokenizer.json at {tokenizer_file}")
        try:
            core = _HFCoreTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust loader raises a bare Exception on bad files
            raise ValueError(f"{tokenizer_file} is not a valid tokenizer.json: {exc}") from exc
        config = _read_json(directory / "tokenizer_config.json")
        special = {
            key: content
            for key in _SPECIAL_TOKEN_KEYS
            if (content := _token_content(config.get(key))) is not None
        }
        template = _select_template(
            config.get("chat_template"), directory / "tokenizer_config.json"
        )
        jinja_file = directory / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        if template is None:
            template = _select_template(
                _read_json(directory / "chat_template.json").get("chat_template"),
                directory / "chat_template.json",
            )
        return cls(
            core, name=directory.resolve().name, special_tokens=special, chat_template=template
        )

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str) -> list[int]:
        return list(self._core.encode(text, add_special_tokens=True).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._core.decode(list(ids), skip_special_tokens=True))

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        """The chat as the template writes it, before tokenization."""
        if self._template is None:
            raise NotTokenizable(f"tokenizer {self.name!r} has no chat template")
        shaped = normalize_messages(messages, content_as_parts=self._content_as_parts)
        try:
            return self._template.render(
                messages=shaped,
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **self._special,
            )
        except (jinja2.exceptions.TemplateError, TypeError) as exc:
            # What SGLang also answers 400 for: raise_exception(), or a filter applied
            # to a value the messages did not provide.
            raise TokenizeError(f"chat template refused the messages: {exc}") from exc

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt)
        return list(self._core.encode(text, add_special_tokens=False).ids)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def load_tokenizer(path: str | None) -> Tokenizer:
    """None or "byte" → ByteTokenizer; a directory or a tokenizer.json path → HFTokenizer.

    Raises `ValueError` with the reason when the path holds no usable tokenizer.
    """
    if path is None or path == "byte":
        return ByteTokenizer()
    return HFTokenizer.from_path(path)
