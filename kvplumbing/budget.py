"""The request-body bytes one process holds at once, bounded in total.

A per-request cap (`--max-payload-size`) bounds one body, not how many arrive together:
clients that each start a large body and finish none of them grew a process by the sum
of what they had sent. A `BodyBudget` is shared by every request a process reads; each
request takes bytes from it as its body arrives and gives them all back when it is over
(answered, refused, or its client gone), so the bytes held never exceed `total`.

The last eighth of the budget is kept for small bodies (up to `small` bytes, a
thousandth of the total): a large body may fill the budget only to `total - reserve`.
Large uploads left unfinished, which fill the budget soonest, then leave room for the
ordinary requests of other clients, which are far smaller.

It is synchronous and touched by one event loop only: a request that does not fit is
refused at once (the caller answers 503), never made to wait, so a full budget cannot
hold a connection open either.
"""

from __future__ import annotations

FLOOR = 256 * 1024 * 1024
"""The least `default_total` gives: a small per-request cap must not also make the number
of ordinary requests read at once small."""


def default_total(per_request: int) -> int:
    """The budget a process gets unless told otherwise: twice the per-request cap (a body
    at the cap, and the reserve and most of another beside it), and at least `FLOOR`."""
    return max(FLOOR, 2 * per_request)


class BodyBudget:
    """Bytes of request bodies held by one process, at most `total` together."""

    __slots__ = ("peak", "reserve", "small", "total", "used")

    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError(f"a body budget must be positive, not {total} bytes")
        self.total = total
        self.reserve = total // 8
        """Bytes only small bodies may take."""
        self.small = total // 1024
        """Bodies of at most this many bytes may take the reserve too."""
        self.used = 0
        self.peak = 0
        """The most bytes held at once since the start."""

    @property
    def largest(self) -> int:
        """The largest single body that fits when nothing else is held."""
        return self.total - self.reserve

    def _room(self, size: int) -> int:
        """What a body of `size` bytes in all may fill the budget up to."""
        return self.total if size <= self.small else self.total - self.reserve

    def fits(self, size: int) -> bool:
        """Whether a body of `size` bytes, none of it taken yet, would fit now (asked of an
        announced length, to refuse it before reading)."""
        return self.used + size <= self._room(size)

    def take(self, held: int, more: int) -> bool:
        """Take `more` bytes for a body that holds `held` already; False, nothing taken,
        when they do not fit (the caller refuses the body and gives back `held`)."""
        used = self.used + more
        if used > self._room(held + more):
            return False
        self.used = used
        self.peak = max(self.peak, used)
        return True

    def give(self, size: int) -> None:
        """Give back `size` bytes a body took (all of them, once, when it is over)."""
        self.used -= size
        assert self.used >= 0, "a body gave back more than it took"
