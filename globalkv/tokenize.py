"""Prompt tokens computed exactly as the engine computes them.

The gateway keys a prompt's blocks to look them up in the index, and the engine keys the
same blocks from the tokens it actually prefilled; a single differing id (a BOS added on
one side only, a special token split into pieces) and every lookup misses. So both sides
share this module:

- `encode(text)` is the engine's plain-text path (`/generate` `text`, a string `prompt`):
  the post-processor runs, so a BOS is added when the model adds one. Which post-processor
  depends on the engines' transformers (`tokenizer_config.TokenizerRules`): with 5.x
  (SGLang 0.5.x) tokenizer.json's own; with 4.x, for Llama/Gemma-style classes, one rebuilt
  from `add_bos_token`/`add_eos_token` in tokenizer_config.json.
- `apply_chat_template(messages)` is the engine's chat path, done the way Hugging Face
  transformers does it: the template is rendered with jinja2 in a sandbox
  (`trim_blocks`, `lstrip_blocks`, `loopcontrols`, transformers' `tojson`,
  `raise_exception`, `strftime_now`, the `{% generation %}` tag) with the special tokens
  (`bos_token`, `eos_token`, …) as variables, then encoded *without* adding special
  tokens, because the template already wrote them.
- Special tokens written in text (`<|im_start|>`) become their single ids in both paths,
  as in the engines (tokenizers' added-token matching). Named special tokens of the
  config that tokenizer.json does not list as added tokens are added, as transformers
  adds them (`tokenizer_config`).

`ByteTokenizer` is a self-contained stand-in for the emulated stack: one id per UTF-8
byte, two special ids and a fixed chat format.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import jinja2
from tokenizers import Tokenizer as _HFCoreTokenizer

from globalkv.chat_template import (
    compile_chat_template,
    select_template,
    template_takes_content_parts,
)
from globalkv.tokenizer_config import TokenizerRules, adopt_config, read_json

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
    def from_path(cls, path: str | Path, *, rules: TokenizerRules = "transformers5") -> HFTokenizer:
        """A model directory (tokenizer.json + tokenizer_config.json) or a tokenizer.json.

        `rules`: the transformers major version of the engines
        (see `tokenizer_config.TokenizerRules`).
        """
        target = Path(path)
        directory = target if target.is_dir() else target.parent
        tokenizer_file = target / "tokenizer.json" if target.is_dir() else target
        if not tokenizer_file.is_file():
            raise ValueError(f"no tokenizer.json at {tokenizer_file}")
        try:
            core = _HFCoreTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust loader raises a bare Exception on bad files
            raise ValueError(f"{tokenizer_file} is not a valid tokenizer.json: {exc}") from exc
        config = read_json(directory / "tokenizer_config.json")
        special = adopt_config(core, config, rules)
        template = select_template(config.get("chat_template"), directory / "tokenizer_config.json")
        jinja_file = directory / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        if template is None:
            template = select_template(
                read_json(directory / "chat_template.json").get("chat_template"),
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


def load_tokenizer(path: str | None, *, rules: TokenizerRules = "transformers5") -> Tokenizer:
    """None or "byte" → ByteTokenizer; a directory or a tokenizer.json path → HFTokenizer;
    a Hugging Face model id (`Qwen/Qwen2.5-0.5B-Instruct`) that is no local path → its
    tokenizer files, from the Hugging Face cache (`hub_tokenizer_dir`).

    Raises `ValueError` with the reason when the path holds no usable tokenizer.
    """
    if path is None or path == "byte":
        return ByteTokenizer()
    if not Path(path).exists() and HUB_ID.fullmatch(path):
        return HFTokenizer.from_path(hub_tokenizer_dir(path), rules=rules)
    return HFTokenizer.from_path(path, rules=rules)


HUB_ID = re.compile(r"(?!.*(--|\.\.))[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}", re.ASCII)
"""A Hugging Face model id, `owner/name`, as the Hub allows them."""

HUB_TOKENIZER_FILES = [
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
]
"""What `HFTokenizer.from_path` reads of a model directory: nothing else is downloaded."""


def hub_tokenizer_dir(model_id: str) -> Path:
    """The directory holding `model_id`'s tokenizer files, downloaded once into the usual
    Hugging Face cache (`HF_HOME`, `HF_HUB_CACHE`) and read from there after; with
    `HF_HUB_OFFLINE=1` only the cache is read. `ValueError` in one line when neither has it.

    The files are the model's, so the gateway tokenizes exactly as the engines that loaded
    the same id do; only the tokenizer files are fetched, never the weights.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        folder = snapshot_download(model_id, allow_patterns=HUB_TOKENIZER_FILES)
    except LocalEntryNotFoundError:
        raise ValueError(
            f"{model_id} is neither a local path nor in the Hugging Face cache, and the Hub "
            "cannot be reached (HF_HUB_OFFLINE=1, or no network): download it where there "
            "is a network, or give a local path"
        ) from None
    except (HfHubHTTPError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{model_id}: cannot fetch its tokenizer from the Hub: {first}") from None
    return Path(folder)
