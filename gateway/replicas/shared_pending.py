"""The other gateway replicas' pending prompts, as heard from their messages, per origin.

Each replica's entries are filed under its name (`origin`) and the serial it gave each
prompt, so that its "done" finds the entry its "add" made and a replica that is gone takes
its entries with it: it will never send the "done" for a prompt still pending when it died,
and a table that kept them would count those prefixes as held by their workers for good.
A replica is gone once it is not among the live members (its heartbeat ran out) and nothing
was heard from it since the member list was asked for: a replica joins the list before it
first sends (`SharedState.step`), so a message heard before the list was asked for comes
from one that was in it.

Every origin may hold at most `ORIGIN_MAX_KEYS` keys, so that one (a replica with a bug, a
stranger with Redis access sending under any name) cannot fill the table the others share
and leave this replica blind to theirs.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from gateway.load.pending import DEFAULT_MAX_KEYS, PendingEntry, PendingHit, PendingPrefixes
from gateway.replicas.shared_wire import Add, Done

ORIGIN_MAX_KEYS = DEFAULT_MAX_KEYS // 4
"""Keys one origin's pending prompts may hold: some 240 prompts of 16k tokens (16-token
blocks) pending at once, and four origins that full before the shared table is."""


@dataclass(slots=True)
class _Origin:
    heard: float
    """When its last message was applied (the caller's clock)."""
    entries: dict[int, PendingEntry] = field(default_factory=dict)
    keys: int = 0


class RemotePending:
    def __init__(self, grace_s: float, origin_max_keys: int = ORIGIN_MAX_KEYS) -> None:
        self.grace_s = grace_s
        self.origin_max_keys = origin_max_keys
        self.table = PendingPrefixes(grace_s)
        self._origins: dict[str, _Origin] = {}

    @property
    def entries(self) -> int:
        return sum(len(o.entries) for o in self._origins.values())

    def origins(self) -> Collection[str]:
        return self._origins.keys()

    def depths(self, keys: Sequence[int], now: float) -> Mapping[str, PendingHit]:
        return self.table.depths(keys, now)

    def apply(self, origin: str, change: Add | Done, now: float) -> None:
        sender = self._origins.get(origin)
        if sender is None:
            sender = self._origins[origin] = _Origin(now)
        sender.heard = now
        if isinstance(change, Add):
            twice = self._pop(sender, change.serial)  # delivered twice: the first must not leak
            if twice is not None:
                self.table.drop(twice)
            room = max(self.origin_max_keys - sender.keys, 0)
            entry = self.table.add(change.worker, change.keys[:room], change.dp_rank)
            sender.entries[change.serial] = entry
            sender.keys += len(entry.keys)
            return
        held = self._pop(sender, change.serial)
        if held is None:
            return  # its add was not heard (sent before we subscribed, or lost)
        if change.computed:
            self.table.settle(held, now)
        else:
            self.table.drop(held)

    def prune(self, live: Collection[str], asked: float) -> int:
        """Forget the origins not in `live` (the members listed at `asked`) and not heard
        since; how many were forgotten."""
        gone = [o for o, s in self._origins.items() if o not in live and s.heard < asked]
        for origin in gone:
            sender = self._origins.pop(origin)
            for entry in sender.entries.values():
                self.table.drop(entry)
        return len(gone)

    @staticmethod
    def _pop(sender: _Origin, serial: int) -> PendingEntry | None:
        held = sender.entries.pop(serial, None)
        if held is not None:
            sender.keys -= len(held.keys)
        return held
