"""SGLang's PD protocol: the same body, bound to the prefill, to both workers at once.

Both the prefill and the decode receive the client's body with `bootstrap_host`,
`bootstrap_port` and `bootstrap_room` (`docs/protocols.md` §2): the decode finds the
prefill's ranks through its bootstrap directory and the room binds the two halves. A batch
gets lists of equal length, one fresh room per element. Every other field is kept as the
client sent it; bootstrap fields the client sent are replaced, because only the gateway
knows which prefill it chose. The client gets the decode's answer (`gateway.legs.calls`).
With `--dp-aware`, a DP rank the room cannot select is named: `routed_dp_rank` to the
prefill, `disagg_prefill_dp_rank` to the decode (`docs/protocols.md` §2). Both calls carry
the client's request id as `X-Request-Id`, and its trace context as it came.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gateway.http.answer import Answer
from gateway.http.upstream import Extra
from gateway.legs.attempt import Attempt, Failure
from gateway.legs.calls import PairCalls
from gateway.requests.bodies import encode_body
from gateway.requests.request import Request
from gateway.routing.plan import RoutePlan
from gateway.routing.rooms import MAX_ROOM


def inject_bootstrap(
    body: Mapping[str, Any],
    batch: int | None,
    *,
    host: str,
    port: int | None,
    rooms: Sequence[int],
) -> dict[str, Any]:
    """A copy of `body` bound to one prefill: `rooms` holds one room per batch element
    (`batch`: elements in the batch, as `gateway.requests.bodies.batch_size` counts them;
    None for a single request)."""
    if batch is None:
        if len(rooms) != 1:
            raise ValueError(f"{len(rooms)} rooms for a request of 1 element(s)")
        room = rooms[0]
        if not 0 < room <= MAX_ROOM:
            raise ValueError("rooms must be in [1, 2^63-1]")
        return {**body, "bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}
    if len(rooms) != batch:
        raise ValueError(f"{len(rooms)} rooms for a request of {batch} element(s)")
    if any(not 0 < room <= MAX_ROOM for room in rooms):
        raise ValueError("rooms must be in [1, 2^63-1]")
    out = dict(body)
    out["bootstrap_host"] = [host] * batch
    out["bootstrap_port"] = [port] * batch
    out["bootstrap_room"] = list(rooms)
    return out


def pair_payloads(request: Request, plan: RoutePlan) -> tuple[bytes, bytes, Extra]:
    """What the prefill and the decode are sent (their bodies, bound to the plan's
    prefill) and the header lines both calls carry."""
    prefill, parsed = plan.prefill, request.parsed
    body = inject_bootstrap(
        parsed.body,
        parsed.batch,
        host=prefill.host,
        port=prefill.bootstrap_port,
        rooms=plan.rooms,
    )
    extra = (*request_id_header(request.request_id), *request.trace_context)
    if plan.pinned_dp_rank is None:
        payload = encode_body(body)
        return payload, payload, extra
    payload = encode_body({**body, "routed_dp_rank": plan.pinned_dp_rank})
    decode_payload = encode_body({**body, "disagg_prefill_dp_rank": plan.pinned_dp_rank})
    return payload, decode_payload, extra


class DualLegs:
    """SGLang attempts: the prefill's and the decode's calls started together."""

    def __init__(self, calls: PairCalls) -> None:
        self.calls = calls

    async def run(self, request: Request, plan: RoutePlan, attempt: Attempt) -> Answer | Failure:
        payload, decode_payload, extra = pair_payloads(request, plan)
        path = request.path
        call = self.calls.start_prefill(plan, path, payload, extra)
        attempt.progress.begin(attempt.number, plan.prefill.id, plan.decode.id, call)
        return await self.calls.decode(
            plan,
            call,
            path,
            decode_payload,
            stream=request.parsed.stream,
            progress=attempt.progress,
            extra=extra,
        )


def request_id_header(request_id: str | None) -> tuple[tuple[bytes, bytes], ...]:
    """The client's request id as the workers receive it (`gateway.serving.edge`)."""
    return () if request_id is None else ((b"X-Request-Id", request_id.encode("ascii")),)
