"""vLLM's PD protocol (its NIXL connector's): the prefill first, then the decode with the
prefill's answer.

One attempt, on a pair the router chose within the vLLM pool:

1. The prefill gets the client's request rewritten to compute the prompt and stop:
   `kv_transfer_params` asking for a remote decode (`do_remote_decode` true, every remote
   field null), `stream` false, `max_tokens` 1 (and `max_completion_tokens` 1 where
   present), without `stream_options`, `min_tokens` or `min_completion_tokens` (vLLM's
   prefill refuses them). Params the client sent are replaced: only the gateway knows
   the pair.
2. Its answer carries a top-level `kv_transfer_params` (`do_remote_prefill`,
   `remote_engine_id`, `remote_request_id`, `remote_block_ids`, `remote_host`,
   `remote_port`, `tp_size`): where the decode pulls the prompt's KV from.
3. The decode gets the client's request as it came, with those params, and its answer goes
   back whole or streamed, exactly as an SGLang decode's does.

Both legs carry one `X-Request-Id`, fresh for each attempt (vLLM pairs the legs by it, so
it must not repeat): the client's request id (`gateway.serving.edge`), a dash and 32 random hex
digits.

A prefill that answers without params still lets the decode serve, but what the decode
then does depends on the prefill's KV connector, which the gateway cannot see: one that
stores the KV under the prompt (ExampleConnector's shared storage, LMCache) hands no
params and its decode loads the prompt by itself; with NIXL (before vLLM returned params
on EOS too) the KV was freed and the decode computes the prompt. So the decode's own
answer decides how it is counted (`decode_kv`): its `usage` says how much of the prompt
it found cached (vLLM reports it with `--enable-prompt-tokens-details`). Each decode sent
after its prefill answered is counted in `globalkv_gateway_vllm_prefilled_decodes{kv}`
(`params`; `prompt`: loaded without params; `unreported`: a stream, or an answer without
the details), or, when its answer says it computed the prompt, in
`globalkv_gateway_vllm_recomputes{reason="no_params"}`. A prefill that fails is retried on
another pair like any failure; the decode is never sent the request without a prefill's
answer, unless `--vllm-allow-recompute` lets the last attempt's decode compute the prompt
itself (`reason="prefill_failed"`).

The calls are the same as SGLang's (`gateway.legs.calls`): the prefill call with its load
and breaker bookkeeping, the decode raced against an already settled prefill, the
deadline's stages (`prefill` until the prefill answered, then `decode`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from random import Random
from typing import Any, Literal

import orjson

from gateway.http.answer import Answer
from gateway.legs.attempt import Attempt, Failure
from gateway.legs.calls import PairCalls
from gateway.legs.racing import answered_call, failed
from gateway.requests.bodies import encode_body
from gateway.requests.request import Request
from gateway.routing.plan import RoutePlan
from gateway.telemetry.metrics import GatewayMetrics

_REMOTE_DECODE: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_PREFILL_DROPS = ("stream_options", "min_tokens", "min_completion_tokens")


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The request as the prefill gets it: compute the prompt, answer one token, keep the KV."""
    out = {key: value for key, value in body.items() if key not in _PREFILL_DROPS}
    out["kv_transfer_params"] = dict(_REMOTE_DECODE)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: Mapping[str, Any], params: Mapping[str, Any] | None) -> dict[str, Any]:
    """The request as the decode gets it: the client's, with the prefill's params (none: the
    decode computes the prompt)."""
    out = dict(body)
    if params is None:
        out.pop("kv_transfer_params", None)
    else:
        out["kv_transfer_params"] = params
    return out


def transfer_params(answer: bytes) -> dict[str, Any] | None:
    """The prefill answer's `kv_transfer_params`, or None when it has none (EOS, or an
    answer that is not the JSON object vLLM writes)."""
    try:
        body = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return None
    params = body.get("kv_transfer_params") if isinstance(body, dict) else None
    return params if isinstance(params, dict) and params else None


DecodeKv = Literal["prompt", "recomputed"]


def decode_kv(answer: bytes, block_size: int | None) -> DecodeKv | None:
    """How a decode sent no params got the prompt's KV, as its whole answer's `usage`
    tells: "prompt" when it found all of the prompt cached but the tokens past the last
    full block and the one every engine computes (what a connector loads from where the
    prefill stored it, or its own cache holds); "recomputed" when it computed more; None
    when the answer does not say. Without the decode's block size, any cached token
    counts as loaded."""
    try:
        body = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return None
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    prompt = _count(usage.get("prompt_tokens"))
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
    if prompt is None or cached is None:
        return None
    if cached == 0:
        return "recomputed"
    if block_size is None:
        return "prompt"
    return "prompt" if prompt - cached <= block_size + 1 else "recomputed"


def _count(value: object) -> int | None:
    valid = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return value if valid and isinstance(value, int) else None


class SequentialLegs:
    """vLLM attempts: the prefill's call, then the decode's with its `kv_transfer_params`."""

    def __init__(self, calls: PairCalls, metrics: GatewayMetrics, *, allow_recompute: bool) -> None:
        self._calls = calls
        self._allow_recompute = allow_recompute
        self._recomputes = metrics.vllm_recomputes
        self._prefilled = {
            kv: metrics.vllm_prefilled_decodes.labels(kv)
            for kv in ("params", "prompt", "unreported")
        }
        self._no_params = metrics.vllm_recomputes.labels("no_params")
        self._ids = Random()
        """Request ids: 128 random bits from a generator seeded by the OS. An id must not
        repeat, but nothing is guarded by its secrecy, so it needs no system call."""

    async def run(self, request: Request, plan: RoutePlan, attempt: Attempt) -> Answer | Failure:
        body, path = request.parsed.body, request.path
        pairing = b"%032x" % self._ids.getrandbits(128)
        if request.request_id is not None:
            pairing = request.request_id.encode("ascii") + b"-" + pairing
        extra = ((b"X-Request-Id", pairing), *request.trace_context)
        payload = encode_body(prefill_body(body))
        call = self._calls.start_prefill(plan, path, payload, extra)
        attempt.progress.begin(attempt.number, plan.prefill.id, plan.decode.id, call)
        try:
            await asyncio.wait((call,))
        except asyncio.CancelledError:
            call.cancel()
            raise
        params: dict[str, Any] | None = None
        prefilled = not failed(call)
        if not prefilled:
            failure = self._calls.prefill_failure(plan, call)
            if not (self._allow_recompute and attempt.final and failure.retryable):
                return failure
            self._recomputes.labels("prefill_failed").inc()
            call = answered_call(call.get_loop())
        else:
            params = transfer_params(call.result().body)
        payload = encode_body(decode_body(body, params))
        answer = await self._calls.decode(
            plan,
            call,
            path,
            payload,
            stream=request.parsed.stream,
            progress=attempt.progress,
            extra=extra,
        )
        if prefilled and isinstance(answer, Answer):
            self._count(answer, params is not None, plan.decode.engine_block_size)
        return answer

    def _count(self, answer: Answer, with_params: bool, block_size: int | None) -> None:
        """A decode that answered after its prefill did, by how it got the prompt's KV."""
        if with_params:
            self._prefilled["params"].inc()
            return
        kv = None if answer.rest is not None else decode_kv(answer.body, block_size)
        if kv == "recomputed":
            self._no_params.inc()
        else:
            self._prefilled[kv or "unreported"].inc()
