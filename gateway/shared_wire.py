"""What gateway replicas read from each other through Redis, checked before it is used.

Anything in Redis may come from another version of the gateway, a replica with a bug, or a
stranger with access to the server: one bad value must cost only itself, never the round
that read it (which would stop sharing and freeze the others' last loads in place) nor the
values a policy or the router trusts (a load below zero, a DP rank that is not one).
"""

from __future__ import annotations

from typing import NamedTuple

MAX_LOAD = 10**12
"""Above any real load (requests, tokens, estimated work of one prefill), and below where one
value would outweigh every other replica's: a load table's entry beyond it is skipped."""


class Load(NamedTuple):
    in_flight: int
    queued: int
    remaining: int


def text(raw: object) -> str | None:
    """A member or worker name as Redis returned it; None if it is not UTF-8 text."""
    if isinstance(raw, str):
        return raw
    if isinstance(raw, bytes):
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return None
    return None


def parse_load(raw: object) -> Load | None:
    """One worker's "in_flight,queued,remaining"; None unless three integers in
    [0, MAX_LOAD]."""
    value = text(raw)
    if value is None:
        return None
    parts = value.split(",")
    if len(parts) != 3:
        return None
    numbers = []
    for part in parts:
        if not part.isascii() or not part.isdigit() or len(part) > 13:
            return None  # also refuses signs, blanks and "1_000", which int() takes
        number = int(part)
        if number > MAX_LOAD:
            return None
        numbers.append(number)
    return Load(*numbers)


def sum_loads(tables: list[object]) -> tuple[dict[str, tuple[int, int, int]], int]:
    """The other replicas' load tables summed per worker, and how many entries were skipped
    as malformed."""
    loads: dict[str, tuple[int, int, int]] = {}
    skipped = 0
    for table in tables:
        if not isinstance(table, dict):
            skipped += 1
            continue
        for raw_worker, raw in table.items():
            worker = text(raw_worker)
            load = parse_load(raw)
            if worker is None or load is None:
                skipped += 1
                continue
            a, b, c = loads.get(worker, (0, 0, 0))
            loads[worker] = (a + load.in_flight, b + load.queued, c + load.remaining)
    return loads, skipped
