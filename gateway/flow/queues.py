"""The waiting requests: one FIFO per (priority band, tenant), bounded, and which goes next.

- **Strict across bands**: the next request is always from the highest priority that has
  one waiting.
- **Fair inside a band**: among the tenants waiting in that band, the one with the least
  recent usage (`gateway.flow.usage`, counted over every replica) goes next, its oldest
  request first; ties go to the tenant that has waited in the band longest.
- **Bounded**: at most `max_requests` requests and `max_bytes` of their bodies wait at
  once, and the tenants kept are bounded by the usage table. A request that does not
  fit takes the place of another only from a lower band, or within its own band from a
  tenant holding at least two more waiting than its own tenant: the lowest band is shed
  first and, inside a band, the tenant holding the most, its newest request (the one
  that would have waited longest). Otherwise it is refused itself. What was shed is
  returned to be answered.

Nothing here waits or reads a clock: `gateway.flow.control` drives it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Literal

from gateway.flow.keys import FlowKey
from gateway.flow.usage import TooManyTenants, Usage
from gateway.requests.query import RouteQuery

RefusalReason = Literal["queue_full", "queue_bytes", "tenants", "shed", "queue_timeout"]


@dataclass(slots=True)
class FlowRequest:
    """What flow control knows of a request: its flow, its price and where it may go."""

    key: FlowKey
    tokens: int
    """Its prompt tokens (estimated from the text without a tokenizer): what it costs."""
    size: int
    """The bytes its body holds while it waits."""
    query: RouteQuery
    """What choosing will read: its tokens, the index's answer, who may serve it."""
    among: Collection[str] | None = None
    """The prefills the entry point may choose among, when it is bounded (an endpoint
    picker's subset hint, in an aggregated pool): only those may take it."""


@dataclass(eq=False, slots=True)
class Waiting:
    request: FlowRequest
    arrived: float
    outcome: asyncio.Future[object] = field(repr=False)
    """Once decided: the reason it was refused while waiting, or its release (the
    headroom's verdict: the prefills it may go to and where it is counted until it is
    sent; or None)."""

    @property
    def tenant(self) -> str:
        return self.request.key.tenant

    @property
    def priority(self) -> int:
        return self.request.key.priority


class Refused(Exception):
    def __init__(self, reason: RefusalReason) -> None:
        super().__init__(reason)
        self.reason: RefusalReason = reason


class FlowQueues:
    def __init__(self, max_requests: int, max_bytes: int, usage: Usage) -> None:
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self.usage = usage
        self._bands: dict[int, dict[str, deque[Waiting]]] = {}
        """Priority -> tenant -> its waiting requests, oldest first; only non-empty ones."""
        self._waiting_of: dict[str, int] = {}
        """Tenant -> its requests waiting, in every band."""
        self.bytes = 0
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def waiting(self, tenant: str) -> bool:
        return tenant in self._waiting_of

    def top(self) -> int | None:
        """The highest priority with a request waiting."""
        return max(self._bands) if self._bands else None

    def has(self, priority: int) -> bool:
        """Whether a request of `priority` is waiting."""
        return priority in self._bands

    def occupancy(self) -> dict[int, int]:
        """Requests waiting per priority."""
        return {p: sum(len(q) for q in band.values()) for p, band in self._bands.items()}

    def head(self) -> Waiting | None:
        """The request to release next."""
        top = self.top()
        if top is None:
            return None
        band = self._bands[top]
        total = self.usage.total
        tenant = min(band, key=total)
        return band[tenant][0]

    def add(self, waiting: Waiting) -> list[Waiting]:
        """Queue `waiting`, shedding what has to make room (returned, out of the queues);
        `Refused` when it cannot be queued."""
        size = waiting.request.size
        if size > self.max_bytes:
            raise Refused("queue_bytes")
        try:
            self.usage.keep(waiting.tenant, self.waiting)
        except TooManyTenants:
            raise Refused("tenants") from None
        shed: list[Waiting] = []
        while self._count >= self.max_requests or self.bytes + size > self.max_bytes:
            victim = self._victim(waiting)
            if victim is None:
                for back in reversed(shed):  # put back what was shed for nothing
                    self._push(back)
                raise Refused("queue_full" if self._count >= self.max_requests else "queue_bytes")
            self.remove(victim)
            shed.append(victim)
        self._push(waiting)
        return shed

    def _push(self, waiting: Waiting) -> None:
        band = self._bands.setdefault(waiting.priority, {})
        queue = band.get(waiting.tenant)
        if queue is None:
            others = [self.usage.total(t) for t in band]
            if others:
                self.usage.lift(waiting.tenant, min(others))
            queue = band[waiting.tenant] = deque()
        queue.append(waiting)
        self._waiting_of[waiting.tenant] = self._waiting_of.get(waiting.tenant, 0) + 1
        self._count += 1
        self.bytes += waiting.request.size

    def _victim(self, newcomer: Waiting) -> Waiting | None:
        lowest = min(self._bands, default=None)
        if lowest is None or lowest > newcomer.priority:
            return None
        band = self._bands[lowest]
        tenant = max(band, key=lambda t: len(band[t]))
        if lowest == newcomer.priority:
            own = len(band.get(newcomer.tenant, ()))
            if len(band[tenant]) < own + 2:
                return None
        return band[tenant][-1]

    def remove(self, waiting: Waiting) -> bool:
        """Take `waiting` out (released, timed out, gone); False when it was not queued."""
        band = self._bands.get(waiting.priority)
        queue = None if band is None else band.get(waiting.tenant)
        if queue is None or band is None:
            return False
        if queue and queue[0] is waiting:
            queue.popleft()
        else:
            try:
                queue.remove(waiting)
            except ValueError:
                return False
        if not queue:
            del band[waiting.tenant]
            if not band:
                del self._bands[waiting.priority]
        left = self._waiting_of[waiting.tenant] - 1
        if left:
            self._waiting_of[waiting.tenant] = left
        else:
            del self._waiting_of[waiting.tenant]
        self._count -= 1
        self.bytes -= waiting.request.size
        return True
