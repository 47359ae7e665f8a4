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

Entries live only while their request is in flight plus the grace, so the table is bounded
by the gateway's concurrency; `max_keys` bounds it in blocks as well (a prompt that does not
fit is tracked for the prefix that does).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

DEFAULT_GRACE_S = 2.0
DEFAULT_MAX_KEYS = 1_000_000


@dataclass(eq=False, slots=True)
class PendingEntry:
    worker: str
    keys: Sequence[int]
    removed: bool = False


class PendingPrefixes:
    def __init__(self, grace_s: float = DEFAULT_GRACE_S, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if grace_s < 0 or max_keys < 0:
            raise ValueError("grace_s and max_keys must not be negative")
        self.grace_s = grace_s
        self.max_keys = max_keys
        self._holders: dict[int, dict[str, int]] = {}
        self._keys = 0
        self._settled: deque[tuple[float, PendingEntry]] = deque()
        self._by_worker: dict[str, set[PendingEntry]] = {}

    @property
    def keys(self) -> int:
        """Block keys held in the table (a key held by two workers counts twice)."""
        return self._keys

    def add(self, worker: str, keys: Sequence[int]) -> PendingEntry:
        room = max(self.max_keys - self._keys, 0)
        kept = keys if len(keys) <= room else keys[:room]
        entry = PendingEntry(worker, kept)
        for key in kept:
            holders = self._holders.setdefault(key, {})
            holders[worker] = holders.get(worker, 0) + 1
        self._keys += len(kept)
        self._by_worker.setdefault(worker, set()).add(entry)
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

    def depths(self, keys: Iterable[int], now: float) -> Mapping[str, int]:
        """Per worker, how many leading blocks of `keys` it was sent and may not show yet."""
        self._expire(now)
        if not self._holders:
            return {}
        found: dict[str, int] = {}
        live: set[str] = set()
        depth = 0
        for key in keys:
            holders = self._holders.get(key)
            if holders is None:
                break
            if depth == 0:
                live = set(holders)
            else:
                for gone in [w for w in live if w not in holders]:
                    live.discard(gone)
                    found[gone] = depth
            depth += 1
            if not live:
                break
        for worker in live:
            found[worker] = depth
        return found

    def _expire(self, now: float) -> None:
        settled = self._settled
        while settled and settled[0][0] <= now:
            self.drop(settled.popleft()[1])

    def drop(self, entry: PendingEntry) -> None:
        """At once: the prefill did not compute the prompt (it failed or was cancelled)."""
        if entry.removed:
            return
        entry.removed = True
        worker = entry.worker
        for key in entry.keys:
            holders = self._holders[key]
            count = holders[worker] - 1
            if count:
                holders[worker] = count
            else:
                del holders[worker]
                if not holders:
                    del self._holders[key]
        self._keys -= len(entry.keys)
        entries = self._by_worker[worker]
        entries.discard(entry)
        if not entries:
            del self._by_worker[worker]
