"""KV-cache events as vLLM and SGLang put them on the wire (PROTOCOLS.md §4).

Data first: the event types every shape decodes into, then the decoder (every batch and
event shape the peers have shipped), then the encoders the engine emulator publishes
with, then the ZMQ frame layouts (live `[topic, seq, payload]` and both replay layouts).

Hashes leave this module as `EngineHash` (unsigned 64-bit): signed ints are masked, the
32-byte digests of `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0` keep their last 8 bytes, which
equals vLLM's own int export. Token ids are validated here, in C, by packing them into an
`array("I")`, so nothing downstream meets a float or a negative token.

Every malformed input raises `WireError`, whose `reason` is a short fixed word fit for a
metric label; ingest counts and drops. Input that is well formed but not for us (an
unknown event type, a `locality: REMOTE` store) is skipped and counted in
`EventBatch.skipped`, so newer engines never break an older indexer.
"""

from __future__ import annotations

import math
import struct
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack

from globalkv.keys import EngineHash

_U64_MASK = 2**64 - 1


# --------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class BlockStored:
    """An engine now holds these blocks; `token_ids` are the tokens of all of them in order.

    `block_size` is tokens per listed block; it is smaller than the engine's page size
    for a partial last block (vLLM ≥ 0.24, SGLang's last page).
    """

    block_hashes: Sequence[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: Sequence[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: Sequence[Any] | None = None
    """vLLM's per-block extra hash inputs (multimodal hashes, cache salt), kept raw."""
    group_idx: int = 0
    """KV-cache group of hybrid models (vLLM ≥ 0.18)."""
    cache_salt: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: Sequence[EngineHash]
    medium: str | None = None
    group_idx: int = 0


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: Sequence[Event]
    dp_rank: int | None = None
    skipped: int = field(default=0, compare=False)
    """Events decoded but not for the index (unknown type, remote locality)."""


class WireError(ValueError):
    """Malformed input; `reason` is a fixed short word (metric label), `detail` says where."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


# --------------------------------------------------------------------------- decode

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
_UNPACK_ERRORS = (
    msgpack.UnpackException,
    ValueError,
    TypeError,
    UnicodeDecodeError,
    OverflowError,
    RecursionError,
)


def decode_batch(payload: bytes) -> EventBatch:
    """One publisher batch from its msgpack payload; raises `WireError` if malformed."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except _UNPACK_ERRORS as exc:
        raise WireError("not_msgpack", f"{type(exc).__name__}: {exc}"[:200]) from None
    if isinstance(raw, list):
        if len(raw) < 2:
            raise WireError("bad_batch", f"batch array has {len(raw)} elements, need 2 or 3")
        ts, events = raw[0], raw[1]
        dp_rank = raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict):
        ts, events = raw.get("ts"), raw.get("events")
        dp_rank = raw.get("data_parallel_rank", raw.get("dp_rank"))
    else:
        raise WireError("bad_batch", f"batch is a {type(raw).__name__}, not an array or map")
    if type(ts) not in (float, int) or not math.isfinite(ts):
        raise WireError("bad_batch", f"ts {ts!r:.40} is not a finite number")
    if not isinstance(events, list):
        raise WireError("bad_batch", f"events is a {type(events).__name__}, not a list")
    if dp_rank is not None and (type(dp_rank) is not int or dp_rank < 0):
        raise WireError("bad_batch", f"dp_rank {dp_rank!r} is not a non-negative int")
    decoded: list[Event] = []
    skipped = 0
    for position, item in enumerate(events):
        event = _decode_event(item, position)
        if event is None:
            skipped += 1
        else:
            decoded.append(event)
    return EventBatch(ts=float(ts), events=decoded, dp_rank=dp_rank, skipped=skipped)


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


def _hashes(value: object, position: int) -> list[EngineHash]:
    if not isinstance(value, list):
        raise WireError("bad_hash", f"event {position}: block_hashes is not a list")
    return [_hash(h, position) for h in value]


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


# --------------------------------------------------------------------------- encode

Flavor = Literal["vllm", "vllm-array", "sglang"]
"""`vllm`: maps, unsigned hashes (vLLM ≥ 0.24); `vllm-array`: arrays (vLLM 0.18–0.23);
`sglang`: maps with signed hashes and no `lora_name` (SGLang 0.5.23)."""

FLAVORS: tuple[Flavor, ...] = ("vllm", "vllm-array", "sglang")


def encode_batch(batch: EventBatch, flavor: Flavor) -> bytes:
    """The payload an engine of `flavor` would publish for `batch`."""
    if flavor == "vllm":
        events: list[object] = [_vllm_map(e) for e in batch.events]
    elif flavor == "vllm-array":
        events = [_vllm_array(e) for e in batch.events]
    elif flavor == "sglang":
        events = [_sglang_map(e) for e in batch.events]
    else:
        raise ValueError(f"unknown flavor {flavor!r}; expected one of {FLAVORS}")
    out: bytes = msgpack.packb([float(batch.ts), events, batch.dp_rank])
    return out


def _signed(h: int) -> int:
    return h - 2**64 if h >= 2**63 else h


def _vllm_map(event: Event) -> dict[str, object]:
    if isinstance(event, BlockStored):
        out: dict[str, object] = {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
        }
        if event.extra_keys is not None:
            out["extra_keys"] = list(event.extra_keys)
        if event.group_idx:
            out["group_idx"] = event.group_idx
        if event.cache_salt is not None:
            out["cache_salt"] = event.cache_salt
        return out
    if isinstance(event, BlockRemoved):
        out = {"type": "BlockRemoved", "block_hashes": list(event.block_hashes)}
        out["medium"] = event.medium
        if event.group_idx:
            out["group_idx"] = event.group_idx
        return out
    return {"type": "AllBlocksCleared"}


def _vllm_array(event: Event) -> list[object]:
    if isinstance(event, BlockStored):
        return [
            "BlockStored",
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            event.lora_id,
            event.medium,
            event.lora_name,
            None if event.extra_keys is None else list(event.extra_keys),
            event.group_idx,
        ]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", list(event.block_hashes), event.medium, event.group_idx]
    return ["AllBlocksCleared"]


def _sglang_map(event: Event) -> dict[str, object]:
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        out: dict[str, object] = {
            "type": "BlockStored",
            "block_hashes": [_signed(h) for h in event.block_hashes],
            "parent_block_hash": None if parent is None else _signed(parent),
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora_id,
        }
        if event.medium is not None:
            out["medium"] = event.medium
        return out
    if isinstance(event, BlockRemoved):
        out = {"type": "BlockRemoved", "block_hashes": [_signed(h) for h in event.block_hashes]}
        if event.medium is not None:
            out["medium"] = event.medium
        return out
    return {"type": "AllBlocksCleared"}


# --------------------------------------------------------------------------- frames

_SEQ = struct.Struct(">Q")
_SIGNED_SEQ = struct.Struct(">q")
END_SEQ = _SIGNED_SEQ.pack(-1)
"""The replay end marker's seq frame: -1 as a signed 8-byte big-endian int."""

ReplayLayout = Literal["seq", "topic"]
"""`seq`: `[b"", seq, payload]` (vLLM ≤ 0.25, SGLang ≤ 0.5.21);
`topic`: `[b"", topic, seq, payload]` (vLLM ≥ 0.26, SGLang ≥ 0.5.22)."""


@dataclass(frozen=True, slots=True)
class Frame:
    """One batch as it travels: live on PUB/SUB, or as a replay reply."""

    topic: bytes
    seq: int
    payload: bytes


def pack_seq(seq: int) -> bytes:
    return _SEQ.pack(seq)


def unpack_seq(data: bytes) -> int:
    if len(data) != 8:
        raise WireError("bad_seq", f"seq frame of {len(data)} bytes, need 8")
    value: int = _SEQ.unpack(data)[0]
    return value


def live_frames(topic: bytes | str, seq: int, payload: bytes) -> list[bytes]:
    """`[topic, seq, payload]` as a PUB socket sends it."""
    topic_bytes = topic.encode() if isinstance(topic, str) else topic
    return [topic_bytes, pack_seq(seq), payload]


def parse_live(frames: Sequence[bytes]) -> Frame:
    if len(frames) != 3:
        raise WireError("bad_frames", f"live message of {len(frames)} frames, need 3")
    return Frame(topic=bytes(frames[0]), seq=unpack_seq(frames[1]), payload=bytes(frames[2]))


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends to a replay ROUTER: `[b"", start_seq]`."""
    return [b"", pack_seq(start_seq)]


def parse_replay_request(frames: Sequence[bytes]) -> int:
    """The start seq of a request as a ROUTER receives it (identity frame removed)."""
    if len(frames) != 2 or frames[0] != b"":
        raise WireError("bad_frames", f"replay request of {len(frames)} frames")
    return unpack_seq(frames[1])


def replay_reply(frame: Frame, layout: ReplayLayout) -> list[bytes]:
    """One buffered batch as a replay ROUTER answers (identity frame not included)."""
    if layout == "seq":
        return [b"", pack_seq(frame.seq), frame.payload]
    return [b"", frame.topic, pack_seq(frame.seq), frame.payload]


def replay_end(layout: ReplayLayout) -> list[bytes]:
    if layout == "seq":
        return [b"", END_SEQ, b""]
    return [b"", b"", END_SEQ, b""]


def parse_replay_reply(frames: Sequence[bytes]) -> Frame | None:
    """A replay reply in either layout as a DEALER receives it; None for the end marker."""
    if len(frames) == 3 and frames[0] == b"":
        topic, seq, payload = b"", frames[1], frames[2]
    elif len(frames) == 4 and frames[0] == b"":
        topic, seq, payload = frames[1], frames[2], frames[3]
    else:
        raise WireError("bad_frames", f"replay reply of {len(frames)} frames")
    if seq == END_SEQ:
        return None
    return Frame(topic=bytes(topic), seq=unpack_seq(seq), payload=bytes(payload))
