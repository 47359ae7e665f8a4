"""Answers in the shapes clients of SGLang and of OpenAI-compatible servers parse.

One `Format` per endpoint family renders a whole answer and, for `stream: true`, the SSE
chunks as tokens arrive. Cached prompt tokens appear where each family's clients look:
`meta_info.cached_tokens` (SGLang `/generate`) and `usage.prompt_tokens_details.
cached_tokens` (OpenAI), so a client of the gateway sees what routing saved on every
answer. Streaming text is cumulative on `/generate` (SGLang's default) and a delta on
the OpenAI endpoints.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from enginesim.engine import Generation, Prompt
from enginesim.textgen import ReplyWriter


@dataclass(slots=True)
class Element:
    """One prompt's progress: what the engine produced so far for it."""

    index: int
    prompt: Prompt
    generation: Generation
    started: float
    output_ids: list[int] = field(default_factory=list)
    sent_text: str = ""
    finished: bool = False

    def meta_info(self, now: float) -> dict[str, Any]:
        generation = self.generation
        return {
            "id": self.prompt.rid,
            "finish_reason": {"type": "length", "length": generation.finish_length}
            if self.finished
            else None,
            "prompt_tokens": generation.prompt_tokens,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": generation.cached_tokens,
            "e2e_latency": round(now - self.started, 6),
            **generation.meta,
        }


def sse(payload: object) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class Format(Protocol):
    def body(self, elements: Sequence[Element]) -> object: ...

    def chunks(self, element: Element) -> list[object]:
        """SSE payloads after `element` got a token or finished."""
        ...

    def tail(self, elements: Sequence[Element]) -> list[object]:
        """Payloads after every element finished (the usage chunk)."""
        ...


def _delta(element: Element, writer: ReplyWriter) -> str:
    text = writer.text(element.output_ids)
    delta = text[len(element.sent_text) :] if text.startswith(element.sent_text) else text
    element.sent_text = text
    return delta


class GenerateFormat:
    def __init__(self, writer: ReplyWriter, *, batch: bool) -> None:
        self._writer = writer
        self._batch = batch

    def _one(self, element: Element) -> dict[str, Any]:
        out: dict[str, Any] = {
            "text": self._writer.text(element.output_ids),
            "output_ids": list(element.output_ids),
            "meta_info": element.meta_info(time.monotonic()),
        }
        if self._batch:
            out["index"] = element.index
        return out

    def body(self, elements: Sequence[Element]) -> object:
        answers = [self._one(e) for e in elements]
        return answers if self._batch else answers[0]

    def chunks(self, element: Element) -> list[object]:
        return [self._one(element)]

    def tail(self, elements: Sequence[Element]) -> list[object]:
        return []


def usage(elements: Sequence[Element], samples: int) -> dict[str, Any]:
    """Prompt and cached tokens count once per prompt, not per sample (n > 1)."""
    firsts = [e for e in elements if e.index % samples == 0]
    prompt_tokens = sum(e.generation.prompt_tokens for e in firsts)
    completion_tokens = sum(len(e.output_ids) for e in elements)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(e.generation.cached_tokens for e in firsts)},
    }


class OpenAIFormat:
    """`/v1/completions` (chat=False) and `/v1/chat/completions` (chat=True)."""

    def __init__(
        self,
        writer: ReplyWriter,
        *,
        chat: bool,
        model: str,
        samples: int,
        include_usage: bool,
        transfer_params: bool = False,
    ) -> None:
        self._writer = writer
        self._transfer_params = transfer_params
        """vLLM's answer: the first prompt's `kv_transfer_params` at the top level."""
        self._chat = chat
        self._model = model
        self._samples = samples
        self._include_usage = include_usage
        self._id = f"{'chatcmpl' if chat else 'cmpl'}-{time.time_ns():x}"
        self._created = int(time.time())
        self._opened: set[int] = set()

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" if self._chat else "text_completion"
        return {
            "id": self._id,
            "object": f"{kind}.chunk" if chunk and self._chat else kind,
            "created": self._created,
            "model": self._model,
        }

    def body(self, elements: Sequence[Element]) -> object:
        choices = []
        for e in elements:
            text = self._writer.text(e.output_ids)
            finish = "stop" if e.generation.stopped else "length"
            choice: dict[str, Any] = {"index": e.index, "finish_reason": finish}
            if self._chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice.update(text=text, logprobs=None)
            choices.append(choice)
        out = {
            **self._envelope(chunk=False),
            "choices": choices,
            "usage": usage(elements, self._samples),
        }
        if self._transfer_params:
            out["kv_transfer_params"] = elements[0].generation.transfer_params if elements else None
        return out

    def chunks(self, element: Element) -> list[object]:
        delta = _delta(element, self._writer)
        if not delta and not element.finished:
            return []
        finish = None
        if element.finished:
            finish = "stop" if element.generation.stopped else "length"
        if self._chat:
            content: dict[str, Any] = {"content": delta}
            if element.index not in self._opened:
                self._opened.add(element.index)
                content = {"role": "assistant", **content}
            choice: dict[str, Any] = {"index": element.index, "delta": content}
        else:
            choice = {"index": element.index, "text": delta, "logprobs": None}
        choice["finish_reason"] = finish
        return [{**self._envelope(chunk=True), "choices": [choice]}]

    def tail(self, elements: Sequence[Element]) -> list[object]:
        if not self._include_usage:
            return []
        return [
            {**self._envelope(chunk=True), "choices": [], "usage": usage(elements, self._samples)}
        ]


def error_body(status: int, message: str, stage: str, *, openai: bool) -> dict[str, Any]:
    """SGLang's `{"error": {...}}` or OpenAI's error object, with the failing stage named."""
    kind = "BadRequestError" if status < 500 else "InternalServerError"
    if openai:
        return {
            "object": "error",
            "message": message,
            "type": kind,
            "param": None,
            "code": status,
            "stage": stage,
        }
    return {"error": {"message": message, "type": kind, "code": status, "stage": stage}}
