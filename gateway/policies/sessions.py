"""Sessions: what a conversation's last turn left where.

A client names its conversation with a header (smg's `X-SMG-Routing-Key`, Dynamo's
`X-Dynamo-Session-ID`); each turn repeats the conversation so far, so the pod that served
the last turn computed its prefix. The table remembers, per session, that pod and the
last turn's prompt (its length and its last block key); the prefix policy counts that
prompt as held there when the new turn extends it and the index does not show it, and so
keeps the conversation there unless another pod would still answer sooner
(`gateway.policies.prefix`).

The table is bounded twice: a binding idle for `ttl` seconds is gone (Dynamo's
`--router-session-affinity-ttl-secs` is such an idle TTL), and past `capacity` bindings
the least recently used goes. Entries are kept in last-use order, so expired ones are
always at the front and dropping them costs nothing per request.

It is per gateway. A replica that never saw a session routes its turn by the index,
which shows the conversation's prefix where the last turn left it, and binds it there:
the binding only breaks ties the index cannot see (a turn whose prefix is not indexed yet
is covered by the pending table, shared through Redis already) or keeps a conversation
when the index cannot answer. Sharing the table would cost a Redis round trip per
request for that.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Turn:
    """A session's last turn: where it went and what it computed there."""

    worker: str
    tokens: int
    """Its prompt's tokens."""
    blocks: int = 0
    """Its prompt's whole index blocks (0 when it was not looked up)."""
    last_key: int | None = None
    """Its prompt's key at its last whole block: a later prompt extends it when its own key
    at that block is the same."""


class SessionTable:
    def __init__(self, ttl: float, capacity: int) -> None:
        if ttl <= 0 or capacity <= 0:
            raise ValueError("a session table needs a positive ttl and capacity")
        self.ttl = ttl
        self.capacity = capacity
        self._bound: OrderedDict[str, tuple[Turn, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._bound)

    def get(self, session: str, now: float) -> Turn | None:
        """The last turn of `session`, if the session is still live at `now`."""
        self._expire(now)
        bound = self._bound.get(session)
        return None if bound is None else bound[0]

    def bind(self, session: str, turn: Turn, now: float) -> None:
        """`session`'s turn was sent at `now` (its idle time starts again)."""
        self._bound[session] = (turn, now)
        self._bound.move_to_end(session)
        while len(self._bound) > self.capacity:
            self._bound.popitem(last=False)

    def _expire(self, now: float) -> None:
        bound = self._bound
        while bound:
            _, (_, used) = next(iter(bound.items()))
            if now - used < self.ttl:
                return
            bound.popitem(last=False)
