"""The directory's state, pure: no I/O, no locks, time from an injected clock.

The server is the only writer and runs on one event loop, so a plain object suffices;
keeping it free of HTTP lets every rule of PROTOCOLS §1.1 and §1.4 be tested directly.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

from bootstrap.protocol import Coordinate, RankAddress, RankRegistration, Topology
from kvplumbing.clock import Clock


class RegistrationRefused(Exception):
    """A registration contradicts the instance established by the first one."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


@dataclass(frozen=True, slots=True)
class RankEntry:
    coordinate: Coordinate
    address: RankAddress
    registered_at: float


@dataclass(frozen=True, slots=True)
class RegisterOutcome:
    """What one accepted registration changed, so the caller can log and count it."""

    coordinate: Coordinate
    address: RankAddress
    previous: RankAddress | None
    registered: int
    expected: int
    became_ready: bool

    @property
    def kind(self) -> Literal["new", "moved", "refreshed"]:
        """A new coordinate, a known one at a new address (a restarted rank), or a repeat."""
        if self.previous is None:
            return "new"
        return "moved" if self.previous != self.address else "refreshed"


_POLICY_TEXT = {
    "decode_allocation_policy": "Inconsistent prefill allocation policies",
    "dsv41_spec_layout": "DeepSeek-V4.1 DSpark PD layout differs across prefill ranks",
}


class Directory:
    """Registrations by coordinate, with readiness over distinct coordinates.

    SGLang counts PUTs, so a rank that registers twice can make it "ready" with another
    rank missing; here readiness means every coordinate of dp*cp*tp*pp is present.
    """

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self._topology: Topology | None = None
        self._ranks: dict[Coordinate, RankEntry] = {}
        self.accepted = 0
        """Registrations accepted, re-registrations included (SGLang's counter)."""

    @property
    def topology(self) -> Topology | None:
        return self._topology

    @property
    def expected(self) -> int | None:
        return None if self._topology is None else self._topology.expected

    @property
    def registered(self) -> int:
        return len(self._ranks)

    @property
    def ready(self) -> bool:
        return self._topology is not None and len(self._ranks) == self._topology.expected

    def register(self, reg: RankRegistration) -> RegisterOutcome:
        """Record a rank, or raise `RegistrationRefused` leaving everything unchanged."""
        topology = Topology.from_registration(reg)
        if self._topology is not None:
            _check_consistent(self._topology, topology, reg)
        was_ready = self.ready
        if self._topology is None:
            self._topology = topology
        coord = reg.coordinate
        previous = self._ranks.get(coord)
        self._ranks[coord] = RankEntry(coord, reg.address, self._clock())
        self.accepted += 1
        return RegisterOutcome(
            coordinate=coord,
            address=reg.address,
            previous=None if previous is None else previous.address,
            registered=len(self._ranks),
            expected=topology.expected,
            became_ready=self.ready and not was_ready,
        )

    def lookup(self, coord: Coordinate) -> RankAddress | None:
        entry = self._ranks.get(coord)
        return None if entry is None else entry.address

    def entries(self) -> list[RankEntry]:
        return [self._ranks[c] for c in sorted(self._ranks)]

    def missing(self) -> list[Coordinate]:
        """Coordinates still to register; empty while the topology is unknown."""
        if self._topology is None:
            return []
        return [c for c in self._topology.coordinates() if c not in self._ranks]

    def reset(self) -> int:
        """Forget the topology and every rank, as a restarted directory would; returns how
        many ranks were dropped. The first registration that follows fixes the topology
        anew, which is the only way to change it without restarting the process."""
        dropped = len(self._ranks)
        self._topology = None
        self._ranks.clear()
        self.accepted = 0
        return dropped


def _check_consistent(established: Topology, offered: Topology, reg: RankRegistration) -> None:
    for name in ("dsv41_spec_layout", "decode_allocation_policy"):
        old, new = getattr(established, name), getattr(offered, name)
        if old != new:
            raise RegistrationRefused(
                name, f"{_POLICY_TEXT[name]}: {name}={new!r}, established {old!r}"
            )
    # The DP dimension is compared through the fields the rank sent, so the refusal
    # names what the operator configured rather than the derived dp_size.
    if established.dp_size != offered.dp_size:
        field = "system_dp_size" if reg.system_dp_size != 1 else "attn_dp_size"
        raise RegistrationRefused(
            field,
            f"{field}={getattr(reg, field)} gives dp_size={offered.dp_size}, "
            f"contradicting the established dp_size={established.dp_size}",
        )
    difference = next(_differences(established, offered), None)
    if difference is not None:
        name, old, new = difference
        field = "load_balance_method" if name == "follow_bootstrap_room" else name
        value = reg.load_balance_method if name == "follow_bootstrap_room" else new
        raise RegistrationRefused(
            field,
            f"{field}={value!r} contradicts the instance's established {name}={old!r}",
        )


def _differences(a: Topology, b: Topology) -> Iterator[tuple[str, object, object]]:
    for name in Topology.model_fields:
        old, new = getattr(a, name), getattr(b, name)
        if old != new:
            yield name, old, new


@dataclass(slots=True)
class _RoomEntry:
    dp_rank: int
    stamp: float


class RoomTable:
    """room -> dp_rank, latest registration wins, bounded in time and in size.

    Entries live exactly `ttl` seconds (SGLang's periodic sweep keeps them 1x-2x its
    interval) and never exceed `max_entries`: when full, the oldest registration goes
    first. Entries are kept in registration order, so both expiry and eviction pop from
    the front in O(1) each.
    """

    def __init__(self, ttl: float, max_entries: int, clock: Clock = time.monotonic) -> None:
        if ttl <= 0:
            raise ValueError("ttl must be positive")
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.ttl = ttl
        self.max_entries = max_entries
        self._clock = clock
        self._entries: OrderedDict[int, _RoomEntry] = OrderedDict()
        self.evicted = 0
        """Entries dropped to respect `max_entries` before their TTL."""
        self.expired = 0
        """Entries dropped because their TTL passed."""

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, room: int, dp_rank: int) -> None:
        now = self._clock()
        self._expire(now)
        self._entries.pop(room, None)
        self._entries[room] = _RoomEntry(dp_rank, now)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
            self.evicted += 1

    def get(self, room: int) -> int | None:
        now = self._clock()
        self._expire(now)
        entry = self._entries.get(room)
        return None if entry is None else entry.dp_rank

    def query(self, rooms: Iterable[int]) -> dict[int, int]:
        """Known rooms among `rooms`; unknown and expired ones are left out."""
        self._expire(self._clock())
        found: dict[int, int] = {}
        for room in rooms:
            entry = self._entries.get(room)
            if entry is not None:
                found[room] = entry.dp_rank
        return found

    def expire(self) -> None:
        """Drop what has outlived the TTL now (also done lazily by every call)."""
        self._expire(self._clock())

    def clear(self) -> int:
        """Drop every entry (counted neither as expired nor as evicted); returns how many."""
        dropped = len(self._entries)
        self._entries.clear()
        return dropped

    def _expire(self, now: float) -> None:
        deadline = now - self.ttl
        entries = self._entries
        while entries:
            entry = next(iter(entries.values()))
            if entry.stamp > deadline:
                break
            entries.popitem(last=False)
            self.expired += 1
