"""What flow control shares with the other replicas through Redis, and what it reads of
theirs, checked before it is used.

Each round of sharing (`gateway.replicas.shared_state`) a replica with `--flow-control`
rewrites one hash, `<prefix>:gw:{<replica>}:flow`, with the TTL of its load table:

    t:<tenant>      its usage: prompt tokens it served the tenant, decayed to the round
    q:<priority>    its requests waiting in that band
    o:<objective>   "<seconds since its last request>,<its typical prompt tokens>", for
                    the objectives with a TTFT that had a request within the reserve

and reads the others'. Why these and nothing else:

- **usage**, so that a tenant served heavily at one replica waits behind the others at
  every replica (fairness counts every replica's service: `FlowControl.usage`);
- **band occupancy**, so that no replica releases a request while another holds a
  request of a higher priority waiting (strict order across replicas), and an objective
  waiting anywhere keeps its headroom everywhere;
- **objectives' last requests**, so that a premium objective active at one replica
  keeps its headroom from the lower priorities of every replica.

Not shared: the queues themselves (a replica's waiting requests are its clients'
connections; it alone can answer them) and the places held under
`--max-concurrent-requests`, which bounds each replica. The others' view is at most about
two intervals old, like their loads; losing Redis forgets it (`forget`), and each
replica then orders only its own requests.

Anything read may come from another version, a replica with a bug or a stranger with
access to Redis: a malformed field costs only itself (skipped and counted), never the
round, and at most `MAX_FIELDS` fields of one replica are read.
"""

from __future__ import annotations

import math

from gateway.flow.control import FlowControl, Others
from gateway.flow.keys import MAX_TENANT_BYTES
from gateway.replicas.shared_wire import text
from gateway.settings.flow import INT32

MAX_USAGE = 1e15
"""Tokens: above any real usage; a value beyond it is skipped."""
MAX_WAITING = 10**9
MAX_AGE_S = 86_400.0
MAX_FIELDS = 20_000
"""Fields read of one replica's hash: its tenants (`--flow-max-tenants`, 10,000 by
default), bands and objectives, with room to spare."""
_VISIBLE = frozenset(range(0x21, 0x7F))


def fields(flow: FlowControl, now: float) -> dict[str, str]:
    """This replica's hash for the round at `now`."""
    out = {
        f"t:{tenant}": repr(round(usage, 3))
        for tenant, usage in flow.usage.own(now, flow.config.max_tenants).items()
    }
    for priority, waiting in flow.queues.occupancy().items():
        out[f"q:{priority}"] = str(waiting)
    horizon = now - flow.config.reserve_secs
    for name, (last, tokens) in flow.seen.items():
        if last >= horizon:
            out[f"o:{name}"] = f"{max(now - last, 0.0):.3f},{tokens:.1f}"
    return out


def absorb(flow: FlowControl, tables: list[object], now: float) -> int:
    """The other replicas' hashes into `flow` (their usage summed per tenant, the highest
    priority waiting anywhere, each objective's latest request); the number of fields
    skipped as malformed. Flow control then looks again at what it holds."""
    usage: dict[str, float] = {}
    top: int | None = None
    active: dict[str, tuple[float, float]] = {}
    skipped = 0
    for table in tables:
        if not isinstance(table, dict):
            skipped += 1
            continue
        for raw_field, raw_value in list(table.items())[:MAX_FIELDS]:
            name, value = text(raw_field), text(raw_value)
            if name is None or value is None or name[1:2] != ":":
                skipped += 1
                continue
            kind, key = name[0], name[2:]
            if kind == "t" and _tenant(key) and (number := _number(value, MAX_USAGE)) is not None:
                usage[key] = usage.get(key, 0.0) + number
            elif kind == "q" and (priority := _priority(key)) is not None and _waiting(value):
                top = priority if top is None else max(top, priority)
            elif kind == "o" and key in flow.timed and (seen := _seen(value)) is not None:
                age, tokens = seen
                last = now - age
                kept = active.get(key)
                if kept is None or last > kept[0]:
                    active[key] = (last, max(tokens, kept[1] if kept else 0.0))
            else:
                skipped += 1
        skipped += max(len(table) - MAX_FIELDS, 0)
    flow.usage.set_others(usage, now)
    flow.others = Others(top, active)
    flow.look()
    return skipped


def forget(flow: FlowControl, now: float) -> None:
    """Sharing failed: order only this replica's requests until it works again."""
    flow.usage.set_others({}, now)
    flow.others = Others()
    flow.look()


def _tenant(key: str) -> bool:
    return 0 < len(key) <= MAX_TENANT_BYTES and _VISIBLE.issuperset(key.encode())


def _number(value: str, limit: float) -> float | None:
    try:
        number = float(value)
    except ValueError:
        return None
    return number if math.isfinite(number) and 0 <= number <= limit else None


def _priority(key: str) -> int | None:
    digits = key[1:] if key[:1] == "-" else key
    if not digits.isascii() or not digits.isdigit() or len(digits) > 10:
        return None
    priority = int(key)
    return priority if -INT32 <= priority < INT32 else None


def _waiting(value: str) -> bool:
    """A count of requests waiting above zero (a zero is not written, but harmless)."""
    ok = value.isascii() and value.isdigit() and len(value) <= 10
    return ok and 0 < int(value) <= MAX_WAITING


def _seen(value: str) -> tuple[float, float] | None:
    parts = value.split(",")
    if len(parts) != 2:
        return None
    age, tokens = _number(parts[0], MAX_AGE_S), _number(parts[1], MAX_USAGE)
    return None if age is None or tokens is None else (age, tokens)
