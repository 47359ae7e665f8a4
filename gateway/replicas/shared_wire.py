"""What gateway replicas read from each other through Redis, checked before it is used.

Anything in Redis may come from another version of the gateway, a replica with a bug, or a
stranger with access to the server: one bad value must cost only itself, never the round
that read it (which would stop sharing and freeze the others' last loads in place) nor the
values a policy or the router trusts (a load below zero, a DP rank that is not one).
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

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


# ---------------------------------------------------------------- pending-table changes

MAX_MESSAGE_BYTES = 8 << 20
"""Longest pending message read; what a replica sends is split well below it
(`MAX_KEYS_PER_MESSAGE`), so only a stranger's is longer."""
MAX_KEYS_PER_ADD = 16_384
"""Keys one prompt is counted pending for: 262,144 tokens (what one lookup may carry, the
indexer's `max_tokens`) in 16-token blocks. A longer prompt is counted for its first
blocks, as a full pending table counts the prefix that fits."""
MAX_KEYS_PER_MESSAGE = 262_144
"""Keys one message carries at most (~6 MB of JSON): a round's changes beyond it are sent
in several messages."""
MAX_UNSENT_KEYS = 4 * MAX_KEYS_PER_MESSAGE
MAX_UNSENT_CHANGES = 65_536
"""What a replica keeps of the changes its failed rounds could not send, for the next
round: the newest, within both bounds. Beyond them Redis has been away long enough that the
others forget this replica's pending prompts anyway (its heartbeat runs out)."""
_KEY_LIMIT = 1 << 64


class Add(NamedTuple):
    serial: int
    worker: str
    keys: list[int]
    dp_rank: int | None


class Done(NamedTuple):
    serial: int
    computed: bool


def _count(value: object) -> bool:
    """A serial, rank or key: an int, not a bool, not below zero."""
    return type(value) is int and value >= 0


def parse_message(data: object) -> tuple[str, list[object]] | None:
    """A pending message's origin and its raw changes; None if it is not one. Parsing is
    bounded: a message too long is not read, one nested too deep is refused by json."""
    if isinstance(data, str):
        data = data.encode()
    if not isinstance(data, bytes) or len(data) > MAX_MESSAGE_BYTES:
        return None
    try:
        message = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(message, dict):
        return None
    origin, changes = message.get("from"), message.get("changes")
    if not isinstance(origin, str) or not isinstance(changes, list):
        return None
    return origin, changes


def parse_change(raw: object) -> Add | Done | None:
    """One change, every field checked; None if malformed. A DP rank that is not one is
    dropped (the keys still tell where the prompt went): the router would fail the request
    it picked for."""
    if not isinstance(raw, list) or not raw:
        return None
    if raw[0] == "add" and len(raw) == 5:
        _, serial, worker, keys, dp_rank = raw
        if not _count(serial) or not isinstance(worker, str) or not isinstance(keys, list):
            return None
        kept = keys[:MAX_KEYS_PER_ADD]
        if not all(type(k) is int and 0 <= k < _KEY_LIMIT for k in kept):
            return None
        return Add(serial, worker, kept, dp_rank if _count(dp_rank) else None)
    if raw[0] == "done" and len(raw) == 3:
        _, serial, computed = raw
        if not _count(serial) or not isinstance(computed, bool):
            return None
        return Done(serial, computed)
    return None


def batches(changes: list[list[Any]]) -> list[list[list[Any]]]:
    """A round's changes in order, as messages of at most `MAX_KEYS_PER_MESSAGE` keys."""
    out: list[list[list[Any]]] = []
    batch: list[list[Any]] = []
    keys = 0
    for change in changes:
        size = keys_in(change)
        if batch and keys + size > MAX_KEYS_PER_MESSAGE:
            out.append(batch)
            batch, keys = [], 0
        batch.append(change)
        keys += size
    if batch:
        out.append(batch)
    return out


def keys_in(change: list[Any]) -> int:
    return len(change[3]) if change[0] == "add" else 0


def encode(member: str, batch: list[list[Any]]) -> str:
    return json.dumps({"from": member, "changes": batch})
