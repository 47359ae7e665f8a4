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

A prefill `q` may take the request when

1. its own objective holds there: `wait(q) <= slack(ttft, own(q) + transfer)`, where the
   slack is `ttft - own - transfer`, or 0 when that is negative (waiting for headroom
   cannot make an objective that an idle prefill cannot: such a request goes to an idle
   one); and
2. for every objective of a higher priority that has a TTFT and is active (it had
   requests within `--flow-reserve-secs`), once this request's work is added to `q`,
   `--flow-reserve-prefills` prefills `p` (all, where there are fewer) still have
   `wait(p) <= slack(ttft, own(p) + transfer)` for that objective's typical request.

The request is released when the prefill expected to answer it first (the least
`wait + own`) may take it, and the release names every prefill that may
(`Verdict.within`): the router then chooses among those alone (`RouteQuery.within`), so
the prefill it chooses, by its own policy, is one where the request's first token is
predicted within its objective and the headroom above is kept. Releasing only when the
soonest prefill may take it keeps a lower band waiting here, in its fair order, rather
than queued behind the work of busy prefills, where nothing orders it. Where the
request names its prefill (a decode's sidecar binds it to the one its picker named),
that prefill alone is judged; where the entry point may choose only among some (an
endpoint picker's subset hint), only those. Should the prefills named all become
ineligible before the request is routed, the router goes where it must (another of the
subset, or any): a request is not refused for a headroom judged a moment earlier.

The second rule is what keeps a premium objective's time to first token when a lower
priority offers more than the prefills can take: the lower priorities fill the prefills
only up to where the premium requests arriving next still find prefills that answer them
in time, which, for objectives near the unloaded time to first token, means idle ones.
One kept prefill is taken by the next premium request, and the next one after that
waits until another prefill frees up; keeping two makes that wait as rare as two premium
requests arriving within one prefill's time (`docs/flow-control.md` measures both).
Before any prefill's rate is measured nothing can be predicted, and "in time" is "idle".

When a request may not go yet, the answer is how long the estimates say until its
soonest prefill may take it: the work ahead drains at one second per second. Flow control
looks again then, or as soon as a request ends. A request released is counted on that
prefill (`placing`) until its load is tracked: several released in one pass must not each
find the same room.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.flow.queues import FlowRequest
from gateway.load.held import held_prefixes
from gateway.load.tracker import Candidate, LoadTracker
from gateway.requests.query import RouteQuery
from gateway.settings.base import Role


class Prefills(Protocol):
    """The prefills a request may go to and the load on them (`gateway.routing.router.Router`)."""

    @property
    def loads(self) -> LoadTracker: ...

    def candidates(self, role: Role, query: RouteQuery) -> Sequence[Candidate]: ...


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
    within: frozenset[str] | None = None
    """The prefills that may take it (None: any)."""


@dataclass(slots=True)
class _Slot:
    worker: str
    wait: float
    own: float
    speed: float | None


class Headroom:
    def __init__(self, router: Prefills, transfer_tokens_per_s: float) -> None:
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
        named, among = request.query.prefill, request.among
        options = [i for i, slot in enumerate(slots) if slot.worker == named]
        if not options and among is not None:
            options = [i for i, slot in enumerate(slots) if slot.worker in among]
        options = options or list(range(len(slots)))
        kept = [_Kept(reserve, slots, self._transfer) for reserve in reserves]
        ttft = request.key.ttft_s
        transfer = request.tokens / self._transfer

        def late(i: int) -> float:
            slot = slots[i]
            own = -math.inf if ttft is None else slot.wait - slack(ttft, slot.own + transfer)
            placed = slot.wait + slot.own if slot.speed is not None else math.inf
            return max([own, *(k.late(i, placed) for k in kept)])

        best = min(options, key=lambda i: slots[i].wait + slots[i].own)
        held = late(best)
        if held > 0:
            return Verdict(held)
        within = frozenset(slots[i].worker for i in options if i == best or late(i) <= 0)
        return Verdict(0.0, slots[best].worker, slots[best].own, within)

    def _slots(self, request: FlowRequest, placing: Mapping[str, float]) -> list[_Slot]:
        router = self._router
        query = request.query
        prefills = router.candidates("prefill", query)
        if not prefills:
            return []
        prompt = request.tokens
        lookup = query.lookup
        if lookup is not None and query.tokens is not None:
            hits = held_prefixes(lookup, prefills, router.loads.pending_blocks(lookup.keys))
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


class _Kept:
    """One reserve's headroom over the prefills: each prefill's shortfall is its wait less
    the slack the reserve's typical request has there (at most 0: in time), and the
    reserve is kept while its `prefills`-th smallest shortfall is at most 0. `late` is that
    shortfall with the request placed on one prefill, from the others' sorted once."""

    __slots__ = ("_kth", "_rank", "_slack", "_sorted")

    def __init__(self, reserve: Reserve, slots: Sequence[_Slot], transfer_tokens_per_s: float):
        transfer = reserve.tokens / transfer_tokens_per_s
        self._slack = [
            slack(reserve.ttft_s, own_s(reserve.tokens, s.speed) + transfer) for s in slots
        ]
        shorts = [s.wait - room for s, room in zip(slots, self._slack, strict=True)]
        order = sorted(range(len(shorts)), key=shorts.__getitem__)
        self._sorted = [shorts[i] for i in order]
        self._rank = [0] * len(shorts)
        for rank, i in enumerate(order):
            self._rank[i] = rank
        self._kth = min(reserve.prefills, len(shorts)) - 1

    def late(self, placed_on: int, placed: float) -> float:
        """The reserve's shortfall once prefill `placed_on`'s wait is `placed`."""
        shorts, kth, rank = self._sorted, self._kth, self._rank[placed_on]
        if rank > kth:
            return shorts[kth]  # a longer wait where it already fell short changes nothing
        # it leaves the `kth + 1` smallest: the others' kth-smallest and next decide
        raised = placed - self._slack[placed_on]
        below = -math.inf if kth == 0 else shorts[kth - 1] if rank == kth else shorts[kth]
        above = shorts[kth + 1] if kth + 1 < len(shorts) else math.inf
        return max(below, min(raised, above))


def own_s(tokens: float, speed: float | None) -> float:
    return 0.0 if speed is None else tokens / speed


def slack(ttft: float, own: float) -> float:
    """The wait a request whose own part takes `own` may have within `ttft`: none when it
    cannot make `ttft` even on an idle prefill (it then waits for an idle one)."""
    return max(ttft - own, 0.0)
