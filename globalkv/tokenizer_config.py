"""tokenizer_config.json as Hugging Face transformers reads it, applied to a tokenizer.json.

A tokenizer.json alone does not encode as the engine does: transformers also adds the
special tokens the config names and tokenizer.json does not list, and (in 4.x, for some
classes) rebuilds where BOS and EOS go from the config's flags. Both are done once, when
`tokenize.HFTokenizer.from_path` loads a model's files; it then encodes with the adjusted
tokenizer as it is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as _HFCoreTokenizer

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


def _added_token(value: object) -> AddedToken | None:
    """A config special token as transformers registers it: special, flags kept."""
    content = _token_content(value)
    if content is None:
        return None
    if not isinstance(value, Mapping):
        return AddedToken(content, special=True, normalized=False)
    flags = {
        key: bool(value[key])
        for key in ("single_word", "lstrip", "rstrip", "normalized")
        if key in value
    }
    return AddedToken(content, special=True, **flags)


def _add_missing_special_tokens(core: _HFCoreTokenizer, config: Mapping[str, Any]) -> None:
    """Named and extra special tokens the config has and tokenizer.json does not add.

    transformers adds each as a special token (a new id when it is not in the vocabulary),
    so written in a prompt it is one id; without this it would be split into pieces here.
    """
    extras = config.get("additional_special_tokens") or config.get("extra_special_tokens")
    if isinstance(extras, Mapping):
        extras = list(extras.values())
    values = [config.get(key) for key in _SPECIAL_TOKEN_KEYS]
    values += extras if isinstance(extras, list) else []
    added = {token.content for token in core.get_added_tokens_decoder().values()}
    missing: list[AddedToken] = []
    for value in values:
        token = _added_token(value)
        if token is not None and token.content not in added:
            added.add(token.content)
            missing.append(token)
    if missing:
        core.add_special_tokens(missing)


TokenizerRules = Literal["transformers5", "transformers4"]
"""Whose rules place BOS/EOS in `encode`: the transformers major version of the engines.

transformers 5 (SGLang 0.5.10–0.5.23 pin 5.3–5.19) drops `add_bos_token`/`add_eos_token`
from tokenizer_config.json whenever a tokenizer.json exists: tokenizer.json's own
post-processor decides. transformers 4 (engines on 4.x) rebuilds the post-processor from
those flags for the Llama/Gemma-style classes below, a missing flag taking the class
default; every other class keeps tokenizer.json's.
"""

_TRANSFORMERS4_FLAG_DEFAULTS = {
    "LlamaTokenizer": (True, False),
    "LlamaTokenizerFast": (True, False),
    "CodeLlamaTokenizer": (True, False),
    "CodeLlamaTokenizerFast": (True, False),
    "GemmaTokenizer": (True, False),
    "GemmaTokenizerFast": (True, False),
    "CohereTokenizerFast": (True, False),
    "GPTNeoXTokenizerFast": (False, False),
}
"""tokenizer_class → (add_bos_token, add_eos_token) defaults, for the classes whose
transformers 4 fast tokenizer calls `update_post_processor` on load."""


def _flagged(
    core: _HFCoreTokenizer, special: Mapping[str, str], key: str, on: bool
) -> tuple[str, int] | None:
    if not on:
        return None
    token = special.get(key)
    if token is None:
        raise ValueError(f"add_{key} is set but tokenizer_config.json names no {key}")
    token_id = core.token_to_id(token)
    assert token_id is not None, "named special tokens were added to the vocabulary"
    return token, token_id


def _apply_bos_eos_flags(
    core: _HFCoreTokenizer,
    config: Mapping[str, Any],
    special: Mapping[str, str],
    rules: TokenizerRules,
) -> None:
    """transformers 4's `update_post_processor`: `[BOS] $A [EOS]` as the flags say."""
    defaults = _TRANSFORMERS4_FLAG_DEFAULTS.get(str(config.get("tokenizer_class")))
    if rules != "transformers4" or defaults is None:
        return
    bos = _flagged(core, special, "bos_token", bool(config.get("add_bos_token", defaults[0])))
    eos = _flagged(core, special, "eos_token", bool(config.get("add_eos_token", defaults[1])))

    def sequence(name: str, type_id: int) -> str:
        ends = [f"{bos[0]}:{type_id}"] if bos else []
        return " ".join([*ends, f"${name}:{type_id}", *([f"{eos[0]}:{type_id}"] if eos else [])])

    core.post_processor = processors.TemplateProcessing(
        single=sequence("A", 0),
        pair=f"{sequence('A', 0)} {sequence('B', 1)}",
        special_tokens=list(dict(t for t in (bos, eos) if t).items()),
    )


def adopt_config(
    core: _HFCoreTokenizer, config: Mapping[str, Any], rules: TokenizerRules
) -> dict[str, str]:
    """Make `core` (tokenizer.json) encode as transformers' tokenizer loaded with `config`
    (tokenizer_config.json) does: the special tokens it names added where tokenizer.json
    lacks them, BOS/EOS placed by `rules`. Returns the named special tokens
    (`bos_token`: its text, …), which chat templates read as variables."""
    special = {
        key: content
        for key in _SPECIAL_TOKEN_KEYS
        if (content := _token_content(config.get(key))) is not None
    }
    _add_missing_special_tokens(core, config)
    _apply_bos_eos_flags(core, config, special, rules)
    return special


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file of a model directory; {} when there is none."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data
