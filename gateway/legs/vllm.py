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

Both legs carry one `X-Request-Id`. A prefill that answers without params (its one token
was EOS, so vLLM's connector kept nothing to send) still lets the decode serve: it
recomputes the prompt, counted in `globalkv_gateway_vllm_recomputes{reason="no_params"}`.
A prefill that fails is retried on another pair like any failure; the decode is never sent
the request without a prefill's answer, unless `--vllm-allow-recompute` lets the last
attempt's decode compute the prompt itself (`reason="prefill_failed"`).

The calls are the dispatcher's own (`gateway.legs.dispatch.Dispatcher`): the prefill call with
its load and breaker bookkeeping, the decode legs raced against an already settled
prefill, the deadline's stages (`prefill` until the prefill answered, then `decode`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from random import Random
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from gateway.http.answer import Answer
from gateway.http.upstream import Extra
from gateway.legs.deadline import Progress
from gateway.legs.racing import Call, failed
from gateway.metrics import GatewayMetrics
from gateway.policies.base import LoadTicket
from gateway.requests import ParsedRequest, encode_body
from gateway.routing.router import RoutePlan
from gateway.workers.pool import Worker

if TYPE_CHECKING:
    from gateway.legs.dispatch import Stream

_REMOTE_DECODE: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_PREFILL_DROPS = ("stream_options", "min_tokens", "min_completion_tokens")
_SETTLED = Answer(200, b"{}")


@dataclass(slots=True)
class Failure:
    """An attempt that ended without an answer to pass on; `answer` is the client's if no
    other attempt does better."""

    role: str
    worker: Worker
    retryable: bool
    answer: Answer


class Legs(Protocol):
    """What a sequential attempt uses of the dispatcher."""

    def start_prefill(
        self, plan: RoutePlan, path: str, payload: bytes, extra: Extra = ()
    ) -> Call: ...

    def prefill_failure(self, plan: RoutePlan, call: Call) -> Failure: ...

    def decode_ticket(self, plan: RoutePlan) -> LoadTicket: ...

    async def whole(
        self,
        plan: RoutePlan,
        call: Call,
        ticket: LoadTicket,
        url: str,
        payload: bytes,
        extra: Extra = (),
    ) -> Answer | Failure: ...

    async def streamed(
        self,
        plan: RoutePlan,
        call: Call,
        ticket: LoadTicket,
        url: str,
        payload: bytes,
        progress: Progress,
        extra: Extra = (),
    ) -> Stream | Failure: ...


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


def _settled(loop: asyncio.AbstractEventLoop) -> Call:
    """A prefill call that succeeded, for a decode sent without one (`--vllm-allow-recompute`)."""
    call: Call = loop.create_future()
    call.set_result(_SETTLED)
    return call


class Sequential:
    """vLLM attempts through the dispatcher's legs."""

    def __init__(self, legs: Legs, metrics: GatewayMetrics, *, allow_recompute: bool) -> None:
        self._legs = legs
        self._allow_recompute = allow_recompute
        self._recomputes = metrics.vllm_recomputes
        self._ids = Random()
        """Request ids: 128 random bits from a generator seeded by the OS. An id must not
        repeat, but nothing is guarded by its secrecy, so it needs no system call."""

    async def attempt(
        self,
        request: ParsedRequest,
        plan: RoutePlan,
        path: str,
        attempt: int,
        progress: Progress,
        *,
        final: bool,
    ) -> Answer | Stream | Failure:
        extra = ((b"X-Request-Id", b"%032x" % self._ids.getrandbits(128)),)
        payload = encode_body(prefill_body(request.body))
        call = self._legs.start_prefill(plan, path, payload, extra)
        progress.begin(attempt, plan.prefill.id, plan.decode.id, call)
        try:
            await asyncio.wait((call,))
        except asyncio.CancelledError:
            call.cancel()
            raise
        params: dict[str, Any] | None = None
        if failed(call):
            failure = self._legs.prefill_failure(plan, call)
            if not (self._allow_recompute and final and failure.retryable):
                return failure
            self._recomputes.labels("prefill_failed").inc()
            call = _settled(call.get_loop())
        else:
            params = transfer_params(call.result().body)
            if params is None:
                self._recomputes.labels("no_params").inc()
        return await self._decode(request, plan, path, call, params, extra, progress)

    async def _decode(
        self,
        request: ParsedRequest,
        plan: RoutePlan,
        path: str,
        call: Call,
        params: dict[str, Any] | None,
        extra: Extra,
        progress: Progress,
    ) -> Answer | Stream | Failure:
        payload = encode_body(decode_body(request.body, params))
        ticket = self._legs.decode_ticket(plan)
        url = plan.decode.url + path
        if request.stream:
            return await self._legs.streamed(plan, call, ticket, url, payload, progress, extra)
        return await self._legs.whole(plan, call, ticket, url, payload, extra)
