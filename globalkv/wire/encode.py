"""The payloads engines of each flavour publish, for the engine emulator and the tests."""

from __future__ import annotations

from typing import Literal

import msgpack

from globalkv.wire.events import BlockRemoved, BlockStored, Event, EventBatch

Flavor = Literal["vllm", "vllm-array", "sglang"]
"""`vllm`: maps, unsigned hashes, the namespace in untagged `extra_keys` (vLLM 0.33);
`vllm-array`: arrays (vLLM 0.18–0.23); `sglang`: maps with signed hashes, the namespace in
`lora_name` and `cache_salt` (SGLang 0.5.23). The tests hold the first and the last to
the engines' own bytes."""

FLAVORS: tuple[Flavor, ...] = ("vllm", "vllm-array", "sglang")


def encode_batch(batch: EventBatch, flavor: Flavor) -> bytes:
    """The payload an engine of `flavor` would publish for `batch`."""
    if flavor == "vllm":
        return _vllm_batch(batch)
    if flavor == "vllm-array":
        events: list[object] = [_vllm_array(e) for e in batch.events]
    elif flavor == "sglang":
        events = [_sglang_map(e) for e in batch.events]
    else:
        raise ValueError(f"unknown flavor {flavor!r}; expected one of {FLAVORS}")
    out: bytes = msgpack.packb([float(batch.ts), events, batch.dp_rank])
    return out


def _vllm_batch(batch: EventBatch) -> bytes:
    """vLLM's bytes exactly: msgspec sizes a struct's map header by the fields the struct
    has, not by those it writes, so a BlockStored (more than 15 fields) always gets a
    16-bit length where msgpack would write a short map."""
    packer = msgpack.Packer()
    parts = [b"\x93", packer.pack(float(batch.ts)), packer.pack_array_header(len(batch.events))]
    for event in batch.events:
        fields = _vllm_map(event)
        if isinstance(event, BlockStored):
            parts.append(b"\xde" + len(fields).to_bytes(2, "big"))
            parts.extend(packer.pack(k) + packer.pack(v) for k, v in fields.items())
        else:
            parts.append(packer.pack(fields))
    parts.append(packer.pack(batch.dp_rank))
    return b"".join(parts)


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
        out["group_idx"] = event.group_idx
        return out
    if isinstance(event, BlockRemoved):
        out = {"type": "BlockRemoved", "block_hashes": list(event.block_hashes)}
        out["medium"] = event.medium
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
        if event.cache_salt is not None:
            out["cache_salt"] = event.cache_salt
        if event.lora_name is not None:
            out["lora_name"] = event.lora_name
        return out
    if isinstance(event, BlockRemoved):
        out = {"type": "BlockRemoved", "block_hashes": [_signed(h) for h in event.block_hashes]}
        if event.medium is not None:
            out["medium"] = event.medium
        return out
    return {"type": "AllBlocksCleared"}
