"""What one batch sends to the apply script, and the writer's view of a source it builds on.

The script (redis_apply.lua, whose header names the ARGV positions) gets flat ARGV: the
checks that make a write refuse stale or lost state, the changed block fields (inline on
one Redis; on a cluster in calls of their own, per master, sent first), the reverse-log
entries and the generation's statistics.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from globalkv.index.base import Source, SourceStats, Tier
from globalkv.index.batch_changes import BatchChanges
from globalkv.index.redis_keys import (
    RedisKeys,
    source_name,
)
from globalkv.index.redis_scripts import fingerprints, log_delete, log_put
from globalkv.index.state import SourceState

_LOG_ENTRY = 4096
"""Records per log entry (a snapshot of a large source is several entries)."""
_LOG_SLACK = 1024
"""Records a log may hold beyond twice the live blocks before it is compacted."""


@dataclass(slots=True)
class Writer:
    state: SourceState
    gen: int | None
    """The source's generation in Redis; None until its first batch creates it."""
    version: int
    """Batches applied to that generation (checked by the apply script)."""
    log_records: int = 0
    """Records in the generation's reverse log (it is compacted when it outgrows the state)."""


class BlockWrites(NamedTuple):
    """The block fields a batch changes, each in its slot (for a cluster to group)."""

    gen: int
    slots: list[int]
    names: list[str]
    values: list[str]


def apply_args(
    keys: RedisKeys,
    token: bytes | None,
    source: Source,
    writer: Writer,
    changes: BatchChanges | None,
    target: int | None,
    seq: int | None,
    ts: float | None,
    *,
    inline: bool,
    fence: tuple[str, str] = ("", ""),
) -> tuple[list[Any], BlockWrites, int]:
    """ARGV of redis_apply.lua's 'batch' call (its header names the positions), the block
    writes (inside that ARGV when `inline`, for one Redis), and how many records the
    generation's log holds once the script ran. `fence`: the pod's fence key and the
    writer's token, or ("", "") for an unfenced write."""
    state = writer.state
    gen = writer.gen
    resetting = changes is None
    args: list[Any] = [
        "batch",
        keys.marker,
        token,
        keys.sources,
        keys.live,
        keys.dead,
        source_name(source),
        "*" if resetting else ("" if gen is None else gen),
        "" if resetting or gen is None else writer.version,
        "" if target is None else target,
        "" if gen is None else keys.info(gen),
    ]
    writing = target if target is not None else gen
    assert writing is not None
    args += [keys.info(writing), keys.log(writing), *fence]
    fresh = target is not None
    writes = BlockWrites(writing, [], [], [])
    records: list[bytes] = []
    snapshot = False
    if changes is not None:
        _block_writes(keys, fingerprints(writing), state, changes, fresh, writes)
        logged = 0 if fresh else writer.log_records
        if logged + len(changes.blocks) > 2 * len(state.blocks) + _LOG_SLACK:
            snapshot = True
            records = [log_put(h, block) for h, block in state.engine_blocks()]
        else:
            for engine_hash in changes.blocks:
                block = state.engine_block(engine_hash)
                if block is not None:
                    records.append(log_put(engine_hash, block))
                elif not fresh:
                    records.append(log_delete(engine_hash))
    entries = [b"".join(records[i : i + _LOG_ENTRY]) for i in range(0, len(records), _LOG_ENTRY)]
    if inline:
        args += (len(writes.names), "\n".join(writes.names), ",".join(writes.values))
    else:
        args += (0, "", "")
    args += ("1" if snapshot else "0", len(entries), *entries)
    logged_after = len(records) if snapshot or fresh else writer.log_records + len(records)
    counts = state.counts
    args += (
        "pod", source.pod, "dp", source.dp_rank, "resets", state.resets,
        "seq", "" if seq is None else seq, "ts", "" if ts is None else repr(ts),
        *(x for bit in sorted(counts) for x in (f"t{bit}", counts[bit])),
    )  # fmt: skip
    return args, writes, logged_after


def _block_writes(
    keys: RedisKeys,
    prints: tuple[int, ...],
    state: SourceState,
    changes: BatchChanges,
    fresh: bool,
    writes: BlockWrites,
) -> None:
    """The changed keys' new field values (0: no longer held), named and placed."""
    masks = state.masks
    slots, names, values = writes.slots, writes.names, writes.values
    for key, at in changes.keys.items():
        old = 0 if fresh else changes.stored_mask(key)
        new = masks.get(key, 0)
        if old != new:
            slot = keys.block_slot(at)
            slots.append(slot)
            names.append(keys.block_in(slot, key))
            values.append(str(prints[new]))


def seq_ts(info: Mapping[bytes | str, bytes | str]) -> tuple[int | None, float | None]:
    seq, ts = info.get(b"seq", b""), info.get(b"ts", b"")
    return (int(seq) if seq else None, float(ts) if ts else None)


def source_stats(source: Source, gen: int, info: Mapping[bytes | str, bytes | str]) -> SourceStats:
    last_seq, last_ts = seq_ts(info)
    return SourceStats(
        source=source,
        epoch=gen,
        blocks={tier: int(info.get(b"t%d" % tier, 0)) for tier in Tier},
        last_seq=last_seq,
        last_event_ts=last_ts,
        resets=int(info.get(b"resets", 0)),
    )
