"""Whether the prefills have room for a request now: its first token predicted within its
objective, and room kept for the objectives above it that keep coming.

The prediction is the one the router already makes (`gateway.routing.decider`'s remote
estimate): on each eligible prefill `p`, the request's first token comes after

    wait(p) = remaining(p) / rate(p)          the work ahead of it there, and
    own(p)  = uncached(p) / rate(p)           its own uncached tokens,

plus its prompt's transfer to the decode (`--pd-transfer-tokens-per-s`); `remaining` is
the load tracker's estimate of what that prefill still has to compute (every replica's,
when they share it), `uncached` the prompt less the longest prefix the index (or this
gateway's pending prompts) shows there, and `rate` the prefill's fitted tokens per second
(`gateway.policies.progress`; the mean of the measured ones for one not yet measured).
The request's prefill is the one that gives its first token soonest. In a decode's
sidecar too, although the picker named one: requests named for different prefills share
the sidecar's queues, and one waiting for its busy prefill would hold back the others.

A request is released when

1. its own objective holds: `wait + own + transfer <= ttft` on its prefill, or that
   prefill has nothing ahead of it (waiting longer would not make an objective it cannot
   make on an idle prefill any closer); and
2. for every objective of a higher priority that has a TTFT and is active (it had
   requests within `--flow-reserve-secs`), once this request's work is added to its
   prefill some prefill still gives that objective's typical request its first token
   within its TTFT, or, where no prefill could even when idle, some prefill still has
   nothing ahead.

The second rule is what keeps a premium objective's time to first token when a lower
priority offers more than the prefills can take: the lower priorities fill the prefills
only up to where a premium request arriving next still finds a prefill that answers it
in time, which, for objectives near the unloaded time to first token, means an idle one.
Before any prefill's rate is measured nothing can be predicted, and "in time" is "idle".

When a request may not go yet, the answer is how long the estimates say until it may:
the work ahead drains at one second per second. Flow control looks again then, or as
soon as a request ends.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from gateway.flow.queues import FlowRequest
from gateway.policies.held import held_prefixes
from gateway.routing.router import Router


@dataclass(frozen=True, slots=True)
class Reserve:
    """An active objective above the request's, whose headroom is kept."""

    ttft_s: float
    tokens: float
    """Prompt tokens typical of its requests."""


@dataclass(slots=True)
class _Slot:
    wait: float
    own: float
    speed: float | None


class Headroom:
    def __init__(self, router: Router, transfer_tokens_per_s: float) -> None:
        self._router = router
        self._transfer = transfer_tokens_per_s

    def late_s(self, request: FlowRequest, reserves: Sequence[Reserve]) -> float:
        """0 when `request` may go now; otherwise the seconds until the estimates say it
        may (infinite when only an answer can change it)."""
        slots = self._slots(request)
        if not slots:
            return 0.0  # nowhere to go: the dispatcher answers why
        best = min(slots, key=lambda s: s.wait + s.own)
        late = 0.0
        ttft = request.key.ttft_s
        if ttft is not None and best.wait > 0:
            late = best.wait + best.own + request.tokens / self._transfer - ttft
        placed = best.wait + best.own if best.speed is not None else math.inf
        for reserve in reserves:
            transfer = reserve.tokens / self._transfer
            after = [
                (placed if slot is best else slot.wait, own_s(reserve.tokens, slot.speed))
                for slot in slots
            ]
            if any(own + transfer <= reserve.ttft_s for _, own in after):
                short = min(wait + own + transfer - reserve.ttft_s for wait, own in after)
            else:
                short = min(wait for wait, _ in after)
            late = max(late, short)
        return late if late > 0 else 0.0

    def _slots(self, request: FlowRequest) -> list[_Slot]:
        router = self._router
        prefills = router.candidates("prefill", (), request.kind, request.model, request.adapters)
        if not prefills:
            return []
        route = request.route
        prompt = request.tokens
        lookup = route.lookup
        if lookup is not None and route.tokens is not None:
            pending = router.loads.pending_blocks(lookup.keys)
            hits = held_prefixes(replace(route, pending=pending), lookup, prefills)
        else:
            hits = [(c, 0, None) for c in prefills]
        loads = router.loads
        rates = {c.worker: loads.load(c.worker).progress.tokens_per_s for c in prefills}
        measured = [r for r in rates.values() if r]
        default = sum(measured) / len(measured) if measured else None
        slots: list[_Slot] = []
        for candidate, hit, _ in hits:
            speed = rates[candidate.worker] or default
            remaining = candidate.remaining_prefill_tokens
            if speed is None:
                slots.append(_Slot(0.0 if remaining == 0 else math.inf, 0.0, None))
            else:
                slots.append(_Slot(remaining / speed, max(prompt - hit, 0) / speed, speed))
        return slots


def own_s(tokens: float, speed: float | None) -> float:
    return 0.0 if speed is None else tokens / speed
