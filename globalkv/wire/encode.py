"""The payloads engines of each flavour publish, for the engine emulator and the tests."""

from __future__ import annotations

from typing import Literal

import msgpack

from globalkv.wire.events import BlockRemoved, BlockStored, Event, EventBatch

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
