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
it must not repeat): the client's request id (`gateway.edge`), a dash and 32 random hex
digits. A prefill that answers without params (its one token
was EOS, so vLLM's connector kept nothing to send) still lets the decode serve: it
recomputes the prompt, counted in `globalkv_gateway_vllm_recomputes{reason="no_params"}`.
A prefill that fails is retried on another pair like any failure; the decode is never sent
the request without a prefill's answer, unless `--vllm-allow-recompute` lets the last
attempt's decode compute the prompt itself (`reason="prefill_failed"`).

The calls are the same as SGLang's (`gateway.legs.calls`): the prefill call with its load
and breaker bookkeeping, the decode raced against an already settled prefill, the
deadline's stages (`prefill` until the prefill answered, then `decode`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from random import Random
from typing import Any

import orjson
from prometheus_client import Counter

from gateway.http.answer import Answer
from gateway.legs.attempt import Attempt, Failure
from gateway.legs.calls import PairCalls
from gateway.legs.racing import answered_call, failed
from gateway.requests import ParsedRequest, encode_body
from gateway.routing.router import RoutePlan

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


class SequentialLegs:
    """vLLM attempts: the prefill's call, then the decode's with its `kv_transfer_params`."""

    def __init__(self, calls: PairCalls, recomputes: Counter, *, allow_recompute: bool) -> None:
        self._calls = calls
        self._allow_recompute = allow_recompute
        self._recomputes = recomputes
        self._ids = Random()
        """Request ids: 128 random bits from a generator seeded by the OS. An id must not
        repeat, but nothing is guarded by its secrecy, so it needs no system call."""

    async def run(
        self, request: ParsedRequest, plan: RoutePlan, path: str, attempt: Attempt
    ) -> Answer | Failure:
        pairing = b"%032x" % self._ids.getrandbits(128)
        if request.request_id is not None:
            pairing = request.request_id.encode("ascii") + b"-" + pairing
        extra = ((b"X-Request-Id", pairing),)
        payload = encode_body(prefill_body(request.body))
        call = self._calls.start_prefill(plan, path, payload, extra)
        attempt.progress.begin(attempt.number, plan.prefill.id, plan.decode.id, call)
        try:
            await asyncio.wait((call,))
        except asyncio.CancelledError:
            call.cancel()
            raise
        params: dict[str, Any] | None = None
        if failed(call):
            failure = self._calls.prefill_failure(plan, call)
            if not (self._allow_recompute and attempt.final and failure.retryable):
                return failure
            self._recomputes.labels("prefill_failed").inc()
            call = answered_call(call.get_loop())
        else:
            params = transfer_params(call.result().body)
            if params is None:
                self._recomputes.labels("no_params").inc()
        payload = encode_body(decode_body(request.body, params))
        return await self._calls.decode(
            plan, call, path, payload, stream=request.stream, progress=attempt.progress, extra=extra
        )
