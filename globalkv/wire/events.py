"""The events every wire shape decodes into, and the one error malformed input raises.

Input that is well formed but not for us (an unknown event type, a `locality: REMOTE`
store) is not an error: it is skipped and counted in `EventBatch.skipped`, so newer
engines never break an older indexer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from globalkv.keys import EngineHash


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
