"""The replay's time and events: what the discrete-event loop (`sim.Run`) is made of.

Simulated time is not the wall clock: the gateway's objects read `SimClock`, which the
loop sets to each event's instant. Events wait in `EventQueue`, earliest first, at equal
instants by their `EventKind` and then as pushed, so a replay is deterministic. `InFlight`
is what the loop keeps of a routed request until its decode ends, and `Rates` the
cluster's rates in wall seconds of the time scale.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

from bench.replay.config import ResolvedCluster
from gateway.load.tracker import LoadTicket


class EventKind(IntEnum):
    """What an event does; at equal instants events run in this order (the heap breaks
    ties by kind, then by push order)."""

    INDEX = 0  # a prefill's KV events reach the index
    KICK = 1  # a pod that may be idle plans its next step
    STEP_END = 2  # a pod's step is over
    ANSWERED = 3  # a prefill answered: its load ends
    DECODED = 4  # the last output token is out: the decode's load ends
    DECODE_END = 5  # with a decider: the last token as last scheduled (stalls move it)


class SimClock:
    """The simulated now, which `LoadTracker` reads."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def read(self) -> float:
        return self.now


class EventQueue:
    """The pending events, earliest first."""

    __slots__ = ("_heap", "_order")

    def __init__(self) -> None:
        self._heap: list[tuple[float, EventKind, int, object]] = []
        self._order = itertools.count()

    def __bool__(self) -> bool:
        return bool(self._heap)

    def next_at(self) -> float:
        return self._heap[0][0]

    def push(self, at: float, kind: EventKind, payload: object) -> None:
        heapq.heappush(self._heap, (at, kind, next(self._order), payload))

    def pop(self) -> tuple[float, EventKind, object]:
        at, kind, _, payload = heapq.heappop(self._heap)
        return at, kind, payload


@dataclass(slots=True)
class InFlight:
    prefill: LoadTicket
    decode: LoadTicket
    output_length: int
    decode_pod: str = ""
    tokens: Sequence[int] = ()
    local: bool = False
    """Prefilled on its decode pod: `prefill` is `decode`, its one ticket."""
    decoded_at: float = 0.0
    """When its last token is due (a `DECODE_END` for another time is stale)."""


@dataclass(slots=True)
class Rates:
    """The cluster's rates in wall seconds of the time scale."""

    transfer_tokens_per_s: float | None
    decode_interval_s: float
    event_delay_s: float

    @classmethod
    def of(cls, cluster: ResolvedCluster, scale: float) -> Rates:
        transfer = cluster.kv_transfer_tokens_per_s
        return cls(
            transfer_tokens_per_s=None if transfer is None else transfer / scale,
            decode_interval_s=scale / cluster.decode_tokens_per_s,
            event_delay_s=cluster.event_delay_s * scale,
        )

    def transfer_s(self, tokens: int) -> float:
        rate = self.transfer_tokens_per_s
        return 0.0 if rate is None else tokens / rate
