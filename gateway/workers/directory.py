"""A prefill's bootstrap directory as the gateway last read it: whether its KV producer
ranks are all registered (ready), and what of its topology routing reads (DP ranks, whether
the room selects the rank). The monitor (`gateway.workers.monitor`) reads it; a worker
(`gateway.workers.pool.Worker`) holds it and is eligible while it is ready or unknown."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class DirectoryStatus(enum.Enum):
    PENDING = "pending"
    """Not read yet: not eligible."""
    READY = "ready"
    NOT_READY = "not_ready"
    UNREACHABLE = "unreachable"
    UNKNOWN = "unknown"
    """No bootstrap port to read: eligible, readiness unknown."""

    @property
    def gauge(self) -> int:
        """1 ready, 0 not ready or unreachable, -1 unknown or pending."""
        if self is DirectoryStatus.READY:
            return 1
        if self in (DirectoryStatus.NOT_READY, DirectoryStatus.UNREACHABLE):
            return 0
        return -1


@dataclass(slots=True)
class Directory:
    status: DirectoryStatus = DirectoryStatus.PENDING
    port: int | None = None
    """The port readiness is read at (given or advertised)."""
    dp_size: int = 1
    follow_bootstrap_room: bool = False
    registered: int | None = None
    expected: int | None = None
    error: str | None = None
    misses: int = 0
    """Consecutive reads that got no answer: a ready directory turns unreachable only after
    the health checks' failure threshold of them, as a worker turns unhealthy (one probe
    timing out in a network hiccup must not take every prefill out at once)."""

    def computing_rank(self, room: int | None = None, pinned: int | None = None) -> int | None:
        """The DP rank that computes a prompt sent with `room` (None: not drawn yet) or
        `pinned` in the request (`--dp-aware`), where it is known: the only one; the one the
        room selects where the prefill follows the room; else the one named. Every load
        started on a prefill keeps its pending blocks on this rank."""
        if self.dp_size <= 1:
            return 0
        if self.follow_bootstrap_room:
            return None if room is None else room % self.dp_size
        return pinned
