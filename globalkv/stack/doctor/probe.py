"""Stage 5: one real request through the gateway, reported by PD stage.

A disaggregated request passes register → resolve → connect → verify-room → consume
(`docs/architecture.md`, "Read path"). The decode times each of them into `meta_info.pd_stages_ms`
and names the stage in every failure (`error.stage`), so the probe's answer says either
how long each stage took or exactly which one failed; stages before a failure are shown
as passed and those after as not reached.

A pool of vLLM workers is probed on `/v1/completions` (vLLM serves no `/generate`): its
answer says the prompt's cached tokens in `usage.prompt_tokens_details`, and a failure
names the engine's stage as OpenAI's error shape carries it; a vLLM decode times no PD
stages.

The probe's prompt starts with a fresh nonce, so its first send is a cache miss
everywhere; sent again, it must come back with cached tokens if routing follows the cache.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from globalkv.stack.doctor.index import SourceKey, applied_counts
from globalkv.stack.doctor.reading import Reader
from globalkv.stack.doctor.report import Stage
from globalkv.stack.views import PodsView
from kvplumbing.clock import Clock, Sleep

PD_STAGES = ("register", "resolve", "connect", "verify-room", "consume")
_FAILED_AT = {
    "register": "register",
    "topology": "register",
    "rank": "resolve",
    "dp_rank": "resolve",
    "register_room": "resolve",
    "handshake": "connect",
    "connect": "connect",
    "transfer": "verify-room",
    "room": "verify-room",
    "consume": "consume",
}
"""The engines' failure stages (`error.stage`) on the probe's five."""
_TIMED_AS = {
    "register": ("register",),
    "resolve": ("rank",),
    "connect": ("connect",),
    "verify-room": ("transfer", "room"),
    "consume": ("consume",),
}
"""The decode's `pd_stages_ms` keys summed into each of the probe's stages."""

_FILLER = (
    "The quick brown fox jumps over the lazy dog while the prefill pod computes the KV "
    "cache of this prompt and the decode pod waits for it to arrive. "
)


def probe_text(nonce: str) -> str:
    """A prompt no cache holds yet, long enough for several blocks with any tokenizer."""
    return f"{nonce}: globalkv doctor probe. " + _FILLER * 6


@dataclass(frozen=True, slots=True)
class ProbeAnswer:
    prompt_tokens: int | None
    cached_tokens: int | None
    meta: dict[str, Any]


def _error(body: object) -> tuple[str, str | None]:
    """(message, engine stage) of an error body in SGLang's, OpenAI's or the gateway's shape."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        error = body["error"]
        stage = error.get("stage")
        return str(error.get("message", "")), stage if isinstance(stage, str) else None
    if isinstance(body, dict) and body.get("object") == "error":
        stage = body.get("stage")
        return str(body.get("message", "")), stage if isinstance(stage, str) else None
    return json.dumps(body)[:300], None


def _json(response: httpx.Response) -> object:
    try:
        return response.json()
    except ValueError:
        return response.text[:300]


def _completion(stage: Stage, body: object, elapsed: float) -> ProbeAnswer | None:
    """A vLLM pool's answer: tokens from `usage`, no PD-stage timings."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        stage.fail("request", "answered 200 without usage: not an OpenAI-style completion")
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    answer = ProbeAnswer(usage.get("prompt_tokens"), cached, {})
    stage.ok("stages", "vLLM pool: the decode times no PD stages")
    stage.ok(
        "answer",
        f"200 in {elapsed * 1000:.0f} ms: {answer.prompt_tokens} prompt tokens, "
        f"{answer.cached_tokens} cached",
    )
    return answer


def interpret(
    stage: Stage, response: httpx.Response | str, elapsed: float, *, vllm: bool = False
) -> ProbeAnswer | None:
    """Findings for every PD stage from one answer; the answer when it succeeded."""
    if isinstance(response, str):
        path = "/v1/completions" if vllm else "/generate"
        stage.fail("gateway", f"POST {path} {response}")
        return None
    body = _json(response)
    if response.status_code != 200:
        message, engine_stage = _error(body)
        failed = _FAILED_AT.get(engine_stage or "")
        if failed is None:
            where = f" at the engine's {engine_stage} stage" if engine_stage else ""
            stage.fail("request", f"HTTP {response.status_code}{where}: {message}")
            return None
        reached = PD_STAGES.index(failed)
        for name in PD_STAGES[:reached]:
            stage.ok(name, "passed")
        stage.fail(failed, f"HTTP {response.status_code} ({engine_stage}): {message}")
        for name in PD_STAGES[reached + 1 :]:
            stage.skip(name, "not reached")
        return None
    if vllm:
        return _completion(stage, body, elapsed)
    meta = body.get("meta_info") if isinstance(body, dict) else None
    if not isinstance(meta, dict):
        stage.fail("request", "answered 200 without meta_info: not an SGLang-style /generate")
        return None
    timings = meta.get("pd_stages_ms")
    if isinstance(timings, dict):
        for name in PD_STAGES:
            values = [timings.get(key) for key in _TIMED_AS[name]]
            numbers = [float(v) for v in values if isinstance(v, int | float)]
            if len(numbers) == len(values):
                stage.ok(name, f"{sum(numbers):.1f} ms")
            else:
                stage.warn(name, "no timing reported")
    else:
        stage.warn("stages", "the decode reported no per-stage timings (not a globalkv engine?)")
    answer = ProbeAnswer(
        prompt_tokens=meta.get("prompt_tokens"), cached_tokens=meta.get("cached_tokens"), meta=meta
    )
    dp_rank = meta.get("prefill_dp_rank")
    stage.ok(
        "answer",
        f"200 in {elapsed * 1000:.0f} ms: {answer.prompt_tokens} prompt tokens, "
        f"{answer.cached_tokens} cached"
        + ("" if dp_rank is None else f", prefill DP rank {dp_rank}"),
    )
    return answer


class Prober:
    def __init__(
        self,
        reader: Reader,
        gateway: str,
        *,
        max_new_tokens: int,
        clock: Clock = time.monotonic,
        vllm: bool = False,
        model: str | None = None,
    ) -> None:
        """`model`: named in the probe, so a gateway with a pool per model routes it to
        that model's pool."""
        self._reader = reader
        self.vllm = vllm
        self._model = model
        self._url = f"{gateway}/v1/completions" if vllm else f"{gateway}/generate"
        self._max_new_tokens = max_new_tokens
        self._clock = clock

    async def send(self, text: str) -> tuple[httpx.Response | str, float]:
        body: dict[str, object] = {
            "text": text,
            "sampling_params": {"max_new_tokens": self._max_new_tokens, "temperature": 0},
        }
        if self.vllm:
            body = {"prompt": text, "max_tokens": self._max_new_tokens, "temperature": 0}
        if self._model is not None:
            body["model"] = self._model
        started = self._clock()
        response = await self._reader.post(self._url, body)
        return response, self._clock() - started


async def wait_applied(
    reader: Reader,
    indexer: str,
    before: dict[SourceKey, int],
    *,
    timeout: float,
    clock: Clock,
    sleep: Sleep,
) -> tuple[SourceKey, float] | None:
    """The first source whose applied batches grew past `before`, and how long that took;
    None if none did within `timeout` (polling the indexer's live state)."""
    started = clock()
    while True:
        pods = await reader.view(f"{indexer}/v1/pods", PodsView)
        if not isinstance(pods, str):
            for key, applied in applied_counts(pods).items():
                if applied > before.get(key, 0):
                    return key, clock() - started
        if clock() - started > timeout:
            return None
        await sleep(0.02)
