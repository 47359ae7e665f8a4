"""Chat templates rendered the way Hugging Face transformers renders them.

The engine's chat path renders the model's template with transformers' jinja2
environment; a gateway that renders it any other way (whitespace control, a missing
filter or global) writes a different prompt, and every index lookup of a chat misses.
This module holds that environment, SGLang's detection of templates that iterate over
content parts, and the choice among named templates in tokenizer_config.json.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["compile_chat_template", "select_template", "template_takes_content_parts"]


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


def select_template(raw: object, source: Path) -> str | None:
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
