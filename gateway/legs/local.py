"""A decode worker that prefills the prompt itself: one call, no PD binding.

Chosen by the decider (`gateway.routing.decider`) for a vLLM decode, which computes a
request sent without `kv_transfer_params` itself, as an aggregated engine would. The decode
gets the client's body as it came (any `kv_transfer_params` the client sent removed: only
the gateway pairs workers) with an `X-Request-Id`; its answer goes back whole or streamed
as a PD decode's does, through the same calls (`gateway.legs.calls`), raced against a
prefill call that has already succeeded, so only the decode's own failures end the
attempt. Its load carries the prompt's uncached tokens until its first token (a stream's
first piece times the decode's prefill rate; a whole answer, which comes with the last
token, does not) and its block keys as pending on that decode.
"""

from __future__ import annotations

import asyncio
from random import Random

from gateway.http.answer import Answer
from gateway.legs.attempt import Attempt, Failure
from gateway.legs.calls import PairCalls
from gateway.legs.racing import answered_call
from gateway.legs.vllm import decode_body
from gateway.requests.bodies import encode_body
from gateway.requests.request import Request
from gateway.routing.plan import RoutePlan


class LocalLegs:
    """Attempts whose decode prefills locally (`RoutePlan.local`)."""

    def __init__(self, calls: PairCalls) -> None:
        self._calls = calls
        self._ids = Random()
        """Request ids, as `gateway.legs.vllm.SequentialLegs` draws them."""

    async def run(self, request: Request, plan: RoutePlan, attempt: Attempt) -> Answer | Failure:
        pairing = b"%032x" % self._ids.getrandbits(128)
        extra = ((b"X-Request-Id", pairing), *request.trace_context)
        payload = encode_body(decode_body(request.parsed.body, None))
        ticket = self._calls.prefill_load(plan)
        call = answered_call(asyncio.get_running_loop())
        attempt.progress.begin(attempt.number, plan.decode.id, plan.decode.id, call)
        return await self._calls.decode(
            plan,
            call,
            request.path,
            payload,
            stream=request.parsed.stream,
            progress=attempt.progress,
            extra=extra,
            ticket=ticket,
        )
