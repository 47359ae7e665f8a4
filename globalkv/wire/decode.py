"""Every batch and event shape the peers have shipped (`docs/protocols.md` §4.2), decoded.

Batches of 2 or 3 elements or a map; events as arrays (vLLM ≤ 0.23, SGLang ≤ 0.5.19) or
maps (newer); unknown fields and extra positions ignored. Token ids are validated here,
in C, by packing them into an `array("I")`, so nothing downstream meets a float or a
negative token.

A batch is decoded on the event loop, and a message of `max_message_bytes` can hold
millions of tiny events, seconds of work: the number of events (and of a map batch's
fields) is read from the msgpack headers first, without building anything, and a batch
past `MAX_BATCH_EVENTS` is refused like any malformed one. What is allowed still takes
about a second to decode, so it is decoded in slices (`decode_steps`) between which the
loop runs.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterator, Mapping
from typing import Any

import msgpack

from globalkv.keys import EngineHash
from globalkv.wire.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    WireError,
)

_U64_MASK = 2**64 - 1

_ARRAY_STORED = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
_ARRAY_REMOVED = ("block_hashes", "medium", "group_idx")
MAX_BATCH_EVENTS = 1 << 16
"""Events one batch may carry. An engine sends a batch per scheduler step: a step's
stored blocks and evictions, a few thousand even for very large steps; the most allowed
decode in about 0.3 s."""
MAX_BATCH_FIELDS = 64
"""Entries of a map-form batch (`ts`, `events`, the DP rank and fields not known yet)."""

_ARRAY_HEADS = frozenset([*range(0x90, 0xA0), 0xDC, 0xDD])
_MAP_HEADS = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])
_STR_HEADS = frozenset([*range(0xA0, 0xC0), 0xD9, 0xDA, 0xDB])
_UNPACK_ERRORS = (
    msgpack.UnpackException,
    ValueError,
    TypeError,
    UnicodeDecodeError,
    OverflowError,
    RecursionError,
)


SLICE_EVENTS = 512
"""Events `decode_steps` decodes between two pauses: about 10 ms on one core."""


def decode_batch(payload: bytes) -> EventBatch:
    """One publisher batch from its msgpack payload; raises `WireError` if malformed."""
    return next(batch for batch in decode_steps(payload) if batch is not None)


def decode_steps(payload: bytes) -> Iterator[EventBatch | None]:
    """`decode_batch` a slice of events at a time: it yields None after every
    `SLICE_EVENTS` events, so a caller on the event loop lets everything else run there,
    and the batch last. An array batch is read element by element from one buffer: the
    largest allowed decoded whole is one C call of a third of a second, which nothing
    could interrupt."""
    _check_size(payload)
    if not payload or payload[0] not in _ARRAY_HEADS:
        yield _batch(_unpack_whole(payload))
        return
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=len(payload))
    unpacker.feed(payload)
    try:
        size = unpacker.read_array_header()
        if size < 2:
            raise WireError("bad_batch", f"batch array has {size} elements, need 2 or 3")
        ts = _check_ts(unpacker.unpack())
        if payload[unpacker.tell()] not in _ARRAY_HEADS:
            events = unpacker.unpack()
            raise WireError("bad_batch", f"events is a {type(events).__name__}, not a list")
        decoded: list[Event] = []
        skipped = 0
        for position in range(unpacker.read_array_header()):
            event = _decode_event(unpacker.unpack(), position)
            if event is None:
                skipped += 1
            else:
                decoded.append(event)
            if position % SLICE_EVENTS == SLICE_EVENTS - 1:
                yield None
        dp_rank = unpacker.unpack() if size > 2 else None
        for _ in range(size - 3):
            unpacker.skip()
        if unpacker.tell() != len(payload):
            raise WireError("not_msgpack", "ExtraData: bytes after the batch")
    except WireError:
        raise
    except (*_UNPACK_ERRORS, IndexError) as exc:
        raise WireError("not_msgpack", f"{type(exc).__name__}: {exc}"[:200]) from None
    _check_dp_rank(dp_rank)
    yield EventBatch(ts=ts, events=decoded, dp_rank=dp_rank, skipped=skipped)


def _unpack_whole(payload: bytes) -> object:
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except _UNPACK_ERRORS as exc:
        raise WireError("not_msgpack", f"{type(exc).__name__}: {exc}"[:200]) from None


def _batch(raw: object) -> EventBatch:
    """A batch that is no array (a map, or garbage) from its decoded value."""
    if not isinstance(raw, dict):
        raise WireError("bad_batch", f"batch is a {type(raw).__name__}, not an array or map")
    ts, events = _check_ts(raw.get("ts")), raw.get("events")
    dp_rank = raw.get("data_parallel_rank", raw.get("dp_rank"))
    if not isinstance(events, list):
        raise WireError("bad_batch", f"events is a {type(events).__name__}, not a list")
    _check_dp_rank(dp_rank)
    decoded: list[Event] = []
    skipped = 0
    for position, item in enumerate(events):
        event = _decode_event(item, position)
        if event is None:
            skipped += 1
        else:
            decoded.append(event)
    return EventBatch(ts=ts, events=decoded, dp_rank=dp_rank, skipped=skipped)


def _check_ts(ts: object) -> float:
    if not isinstance(ts, float | int) or isinstance(ts, bool) or not math.isfinite(ts):
        raise WireError("bad_batch", f"ts {ts!r:.40} is not a finite number")
    return float(ts)


def _check_dp_rank(dp_rank: object) -> None:
    if dp_rank is not None and (type(dp_rank) is not int or dp_rank < 0):
        raise WireError("bad_batch", f"dp_rank {dp_rank!r} is not a non-negative int")


def _check_size(payload: bytes) -> None:
    """Refuse a batch with too many events before any of them is built. Only headers are
    read and other values skipped (in C); a payload not laid out as a batch is left for
    the full decode to refuse with its reason."""
    if not payload or payload[0] not in _ARRAY_HEADS | _MAP_HEADS:
        return
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=len(payload))
    unpacker.feed(payload)
    events: list[int] = []
    fields = 0
    try:
        if payload[0] in _ARRAY_HEADS:
            if unpacker.read_array_header() >= 2:
                unpacker.skip()  # ts
                if payload[unpacker.tell()] in _ARRAY_HEADS:
                    events.append(unpacker.read_array_header())
        elif (fields := unpacker.read_map_header()) <= MAX_BATCH_FIELDS:
            for _ in range(fields):
                key = unpacker.unpack() if payload[unpacker.tell()] in _STR_HEADS else None
                if key != "events" or payload[unpacker.tell()] not in _ARRAY_HEADS:
                    unpacker.skip()
                    continue
                events.append(unpacker.read_array_header())
                if events[-1] > MAX_BATCH_EVENTS:
                    break
                for _ in range(events[-1]):  # on to the next key: "events" may come twice
                    unpacker.skip()
    except (*_UNPACK_ERRORS, IndexError):
        return
    if fields > MAX_BATCH_FIELDS:
        raise WireError(
            "bad_batch", f"batch map has {fields} entries, more than {MAX_BATCH_FIELDS}"
        )
    if events and max(events) > MAX_BATCH_EVENTS:
        raise WireError(
            "bad_batch", f"batch has {max(events)} events, more than {MAX_BATCH_EVENTS}"
        )


def _decode_event(item: object, position: int) -> Event | None:
    if isinstance(item, list):
        if not item:
            raise WireError("bad_event", f"event {position} is an empty array")
        tag = item[0]
        names = _ARRAY_STORED if tag == "BlockStored" else _ARRAY_REMOVED
        fields: Mapping[Any, Any] = dict(zip(names, item[1:], strict=False))
    elif isinstance(item, dict):
        tag = item.get("type")
        fields = item
    else:
        raise WireError("bad_event", f"event {position} is a {type(item).__name__}")
    if not isinstance(tag, str):
        raise WireError("bad_event", f"event {position} has tag {tag!r}")
    if tag == "BlockStored":
        if fields.get("locality") == "REMOTE":
            return None
        return _stored(fields, position)
    if tag == "BlockRemoved":
        return BlockRemoved(
            block_hashes=_hashes(fields.get("block_hashes"), position),
            medium=_opt_str(fields.get("medium"), "medium", position),
            group_idx=_group(fields.get("group_idx"), position),
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def _stored(fields: Mapping[Any, Any], position: int) -> BlockStored:
    block_size = fields.get("block_size")
    if type(block_size) is not int or block_size <= 0:
        raise WireError("bad_field", f"event {position}: block_size {block_size!r}")
    lora_id = fields.get("lora_id")
    if lora_id is not None and type(lora_id) is not int:
        raise WireError("bad_field", f"event {position}: lora_id {lora_id!r}")
    parent = fields.get("parent_block_hash")
    extra_keys = fields.get("extra_keys")
    if extra_keys is not None and not isinstance(extra_keys, list):
        raise WireError("bad_field", f"event {position}: extra_keys is not a list")
    return BlockStored(
        block_hashes=_hashes(fields.get("block_hashes"), position),
        parent_block_hash=None if parent is None else _hash(parent, position),
        token_ids=_tokens(fields.get("token_ids"), position),
        block_size=block_size,
        lora_id=lora_id,
        medium=_opt_str(fields.get("medium"), "medium", position),
        lora_name=_opt_str(fields.get("lora_name"), "lora_name", position),
        extra_keys=extra_keys,
        group_idx=_group(fields.get("group_idx"), position),
        cache_salt=_opt_str(fields.get("cache_salt"), "cache_salt", position),
    )


def _hash(value: object, position: int) -> EngineHash:
    if type(value) is int:
        return EngineHash(value & _U64_MASK)
    if isinstance(value, bytes) and value:
        return EngineHash(int.from_bytes(value[-8:], "big"))
    raise WireError("bad_hash", f"event {position}: hash {value!r:.60}")


def _hashes(value: object, position: int) -> tuple[EngineHash, ...]:
    """A tuple, not a list: a tuple of ints leaves the garbage collector's care at its
    first collection, and a large batch holds one per event (`bench.ingest_stall`)."""
    if not isinstance(value, list):
        raise WireError("bad_hash", f"event {position}: block_hashes is not a list")
    return tuple([_hash(h, position) for h in value])


def _tokens(value: object, position: int) -> array[int]:
    if not isinstance(value, list):
        raise WireError("bad_tokens", f"event {position}: token_ids is not a list")
    try:
        return array("I", value)
    except (OverflowError, TypeError):
        raise WireError("bad_tokens", f"event {position}: token ids must be u32 integers") from None


def _opt_str(value: object, name: str, position: int) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise WireError("bad_field", f"event {position}: {name} {value!r:.60}")


def _group(value: object, position: int) -> int:
    if value is None:
        return 0
    if type(value) is not int or value < 0:
        raise WireError("bad_field", f"event {position}: group_idx {value!r:.60}")
    return value
