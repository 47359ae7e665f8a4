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
(`gateway.load.progress`; the mean of the measured ones for one not yet measured).
The request's prefill is the one that gives its first token soonest. In a decode's
sidecar too, although the picker named one: requests named for different prefills share
the sidecar's queues, and one waiting for its busy prefill would hold back the others.

A request is released when

1. its own objective holds: on its prefill, `wait <= slack(ttft, own + transfer)`, where
   the slack is `ttft - own - transfer`, or 0 when that is negative (waiting for
   headroom cannot make an objective that an idle prefill cannot: such a request goes
   to an idle one); and
2. for every objective of a higher priority that has a TTFT and is active (it had
   requests within `--flow-reserve-secs`), once this request's work is added to its
   prefill, `--flow-reserve-prefills` prefills `p` (all, where there are fewer) still
   have `wait(p) <= slack(ttft, own(p) + transfer)` for that objective's typical
   request.

The second rule is what keeps a premium objective's time to first token when a lower
priority offers more than the prefills can take: the lower priorities fill the prefills
only up to where the premium requests arriving next still find prefills that answer them
in time, which, for objectives near the unloaded time to first token, means idle ones.
One kept prefill is taken by the next premium request, and the next one after that
waits until another prefill frees up; keeping two makes that wait as rare as two premium
requests arriving within one prefill's time (`docs/flow-control.md` measures both).
Before any prefill's rate is measured nothing can be predicted, and "in time" is "idle".

When a request may not go yet, the answer is how long the estimates say until it may:
the work ahead drains at one second per second. Flow control looks again then, or as
soon as a request ends. A request released is counted on its prefill (`placing`) until
its load is tracked: several released in one pass must not each find the same room.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
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
    prefills: int = 1
    """Prefills kept within its slack (`--flow-reserve-prefills`)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    late_s: float
    """0 when the request may go now; else the seconds until the estimates say it may
    (infinite when only an answer can change it)."""
    prefill: str | None = None
    """The prefill expected to answer it first, where it is counted until it is sent."""
    work_s: float = 0.0
    """Its work there, in seconds."""


@dataclass(slots=True)
class _Slot:
    worker: str
    wait: float
    own: float
    speed: float | None


class Headroom:
    def __init__(self, router: Router, transfer_tokens_per_s: float) -> None:
        self._router = router
        self._transfer = transfer_tokens_per_s

    def assess(
        self,
        request: FlowRequest,
        reserves: Sequence[Reserve],
        placing: Mapping[str, float] | None = None,
    ) -> Verdict:
        """Whether `request` may go now, `placing` (seconds of work per prefill) counted
        as already sent: the requests released whose load is not yet tracked."""
        slots = self._slots(request, placing or {})
        if not slots:
            return Verdict(0.0)  # nowhere to go: the dispatcher answers why
        best = min(slots, key=lambda s: s.wait + s.own)
        late = 0.0
        ttft = request.key.ttft_s
        if ttft is not None:
            late = best.wait - slack(ttft, best.own + request.tokens / self._transfer)
        placed = best.wait + best.own if best.speed is not None else math.inf
        for reserve in reserves:
            transfer = reserve.tokens / self._transfer
            shorts = sorted(
                (placed if slot is best else slot.wait)
                - slack(reserve.ttft_s, own_s(reserve.tokens, slot.speed) + transfer)
                for slot in slots
            )
            late = max(late, shorts[min(reserve.prefills, len(shorts)) - 1])
        return Verdict(late if late > 0 else 0.0, best.worker, best.own)

    def _slots(self, request: FlowRequest, placing: Mapping[str, float]) -> list[_Slot]:
        router = self._router
        query = request.query
        prefills = router.candidates("prefill", query)
        if not prefills:
            return []
        prompt = request.tokens
        lookup = query.lookup
        if lookup is not None and query.tokens is not None:
            pending = router.loads.pending_blocks(lookup.keys)
            hits = held_prefixes(replace(query, pending=pending), lookup, prefills)
        else:
            hits = [(c, 0, None) for c in prefills]
        loads = router.loads
        rates = {c.worker: loads.load(c.worker).progress.tokens_per_s for c in prefills}
        measured = [r for r in rates.values() if r]
        default = sum(measured) / len(measured) if measured else None
        slots: list[_Slot] = []
        for candidate, hit, _ in hits:
            worker = candidate.worker
            speed = rates[worker] or default
            remaining = candidate.remaining_prefill_tokens
            sent = placing.get(worker, 0.0)
            if speed is None:
                idle = remaining == 0 and sent == 0
                slots.append(_Slot(worker, 0.0 if idle else math.inf, 0.0, None))
            else:
                own = max(prompt - hit, 0) / speed
                slots.append(_Slot(worker, remaining / speed + sent, own, speed))
        return slots


def own_s(tokens: float, speed: float | None) -> float:
    return 0.0 if speed is None else tokens / speed


def slack(ttft: float, own: float) -> float:
    """The wait a request whose own part takes `own` may have within `ttft`: none when it
    cannot make `ttft` even on an idle prefill (it then waits for an idle one)."""
    return max(ttft - own, 0.0)
