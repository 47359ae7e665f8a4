"""Prefixes this gateway has sent to a prefill that the index cannot show yet.

A prompt's blocks reach the index only once its prefill has computed them and the
engine's events have arrived: seconds later under load. Prompts sharing that prefix which
arrive meanwhile (a group's other questions, a burst on one system prompt) would find no
hit anywhere, be spread by load, and each compute the prefix again, although the engine,
which matches its cache when it plans a request's first chunk, would have reused it had
they gone to the same pod. So the gateway counts a routed prompt's blocks as held by its
worker from the routing decision until `grace_s` after the prefill answered, by when the
index shows what the engine really kept: events take milliseconds to arrive
(`bench/freshness.py`), the grace is seconds. A prefill that failed drops them at once.

Each routed prompt is one entry holding its key chain as a set, filed under its first key.
A key is chained to everything before it, so an entry holding a prompt's i-th key holds all
the keys before it too: a worker's depth for a new prompt is found by binary search over
the prompt's keys in each entry sharing its first key, and an entry leaves in O(1). Entries
live only while their request is in flight plus the grace, so the table is bounded by the
gateway's concurrency; `max_keys` bounds it in keys as well (a prompt that does not fit is
kept for the prefix that does). What a routed request pays here: `docs/gateway-design.md`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

DEFAULT_GRACE_S = 2.0
DEFAULT_MAX_KEYS = 1_000_000


class PendingHit(NamedTuple):
    blocks: int
    """Leading blocks of the prompt sent to the worker."""
    dp_rank: int | None
    """The DP rank computing them, when the gateway knows it (its room selects it)."""


# Built per request: its own __init__, compiled where the module is (the dataclass gives
# eq and repr only; its generated __init__ runs interpreted): docs/gateway-design.md.
@dataclass(eq=False, slots=True, init=False)
class PendingEntry:
    worker: str
    keys: frozenset[int]
    first: int | None
    """None: nothing was kept (an empty prompt, or the table was full)."""
    dp_rank: int | None
    removed: bool

    def __init__(
        self,
        worker: str,
        keys: frozenset[int],
        first: int | None,
        dp_rank: int | None = None,
        removed: bool = False,
    ) -> None:
        self.worker = worker
        self.keys = keys
        self.first = first
        self.dp_rank = dp_rank
        self.removed = removed


class PendingPrefixes:
    def __init__(self, grace_s: float = DEFAULT_GRACE_S, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if grace_s < 0 or max_keys < 0:
            raise ValueError("grace_s and max_keys must not be negative")
        self.grace_s = grace_s
        self.max_keys = max_keys
        self._by_first: dict[int, set[PendingEntry]] = {}
        self._by_worker: dict[str, set[PendingEntry]] = {}
        self._settled: deque[tuple[float, PendingEntry]] = deque()
        self._keys = 0

    @property
    def keys(self) -> int:
        """Keys held in the table (a key sent to two workers counts twice)."""
        return self._keys

    def add(self, worker: str, keys: Sequence[int], dp_rank: int | None = None) -> PendingEntry:
        room = max(self.max_keys - self._keys, 0)
        kept = keys if len(keys) <= room else keys[:room]
        if not kept:
            return PendingEntry(worker, frozenset(), None)
        entry = PendingEntry(worker, frozenset(kept), kept[0], dp_rank)
        self._by_first.setdefault(kept[0], set()).add(entry)
        self._by_worker.setdefault(worker, set()).add(entry)
        self._keys += len(entry.keys)
        return entry

    def settle(self, entry: PendingEntry, now: float) -> None:
        """The prefill answered at `now`: drop the entry once the index has caught up."""
        if self.grace_s == 0:
            self.drop(entry)
        else:
            self._settled.append((now + self.grace_s, entry))

    def forget(self, worker: str) -> None:
        for entry in list(self._by_worker.get(worker, ())):
            self.drop(entry)

    def depths(self, keys: Sequence[int], now: float) -> Mapping[str, PendingHit]:
        """Per worker, how many leading blocks of `keys` it was sent and may not show yet
        (the longest of its entries), and on which DP rank."""
        self.expire(now)
        if not self._by_first or not keys:
            return {}
        entries = self._by_first.get(keys[0])
        if not entries:
            return {}
        found: dict[str, PendingHit] = {}
        keys = list(keys)  # a plain list: KeyChain's item access is a Python call
        last = len(keys)
        for entry in entries:
            held = entry.keys
            if keys[last - 1] in held:
                depth = last
            else:
                depth, beyond = 1, last
                while beyond - depth > 1:
                    middle = (depth + beyond) // 2
                    if keys[middle - 1] in held:
                        depth = middle
                    else:
                        beyond = middle
            held_before = found.get(entry.worker)
            if held_before is None or depth > held_before.blocks:
                found[entry.worker] = PendingHit(depth, entry.dp_rank)
        return found

    def expire(self, now: float) -> None:
        """Drop the entries whose grace has passed (lookups do it first, and so do scrapes)."""
        settled = self._settled
        while settled and settled[0][0] <= now:
            self.drop(settled.popleft()[1])

    def drop(self, entry: PendingEntry) -> None:
        """Remove the entry now: its grace passed, its worker left, or its prefill computed
        nothing (it failed or was cancelled)."""
        if entry.removed or entry.first is None:
            return
        entry.removed = True
        sent = self._by_worker[entry.worker]
        sent.discard(entry)
        if not sent:
            del self._by_worker[entry.worker]
        sharing = self._by_first[entry.first]
        sharing.discard(entry)
        if not sharing:
            del self._by_first[entry.first]
        self._keys -= len(entry.keys)
