"""Engine events become index events here, and nowhere else: one reading of each engine's
dialect, so a batch means the same to the index whichever socket brought it.

The index needs three things the wire does not state directly: the chain's namespace
(model + LoRA name + cache salt, `keys.root_key`), the tier (each engine names its media
differently), and whether a store can be keyed from its tokens at all. What cannot be
keyed correctly is skipped and counted by reason, never guessed: an index that forgets
gives fewer hits, a guessing one gives wrong ones.

- `medium`: vLLM says GPU/CPU/STORAGE, SGLang GPU/CPU_PINNED/DISK/EXTERNAL, old versions
  nothing (GPU). An unknown medium is skipped (`medium`).
- `group_idx` ≠ 0: hybrid models publish one event per KV-cache group for the same
  tokens; the index follows group 0 only (`group`).
- `extra_keys`: vLLM mixes multimodal hashes (and the cache salt) into block hashes. A
  store whose extra keys hold anything but its own cache salt depends on inputs a
  gateway cannot see, so it is skipped (`extra_keys`); its children then count as
  orphans in the index, which is the truth: no token-only request shares that prefix.
- LoRA: `lora_name` when given; an old event with only a `lora_id` gets a namespace no
  request can produce (`#lora-id:N`), so it never collides with the base model.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from globalkv.index.base import ClearSource, IndexEvent, RemoveBlocks, StoreBlocks, Tier
from globalkv.keys import BlockKey, root_key
from globalkv.wire import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

MEDIUM_TIERS: dict[str | None, Tier] = {
    None: Tier.GPU,
    "GPU": Tier.GPU,
    "CPU": Tier.CPU,
    "CPU_PINNED": Tier.CPU,
    "STORAGE": Tier.DISK,
    "DISK": Tier.DISK,
    "EXTERNAL": Tier.DISK,
}


@dataclass(slots=True)
class Translated:
    ts: float
    """The batch's publish time (engine clock)."""
    events: list[IndexEvent]
    skipped: Counter[str] = field(default_factory=Counter)
    """Engine events not turned into index events, by reason."""


@lru_cache(maxsize=4096)
def namespace(model: str, lora_name: str | None, cache_salt: str | None) -> BlockKey:
    """Cached: every store of a pod asks for the same few namespaces."""
    return root_key(model, lora_name, cache_salt)


def _extra_keys_keyable(extra_keys: Sequence[object] | None, cache_salt: str | None) -> bool:
    if not extra_keys:
        return True
    for block_keys in extra_keys:
        if block_keys is None:
            continue
        if not isinstance(block_keys, list | tuple):
            return False
        if any(k != cache_salt for k in block_keys):
            return False
    return True


def translate(batch: EventBatch, model: str) -> Translated:
    """The index events of one decoded batch from a pod serving `model`."""
    out = Translated(ts=batch.ts, events=[])
    if batch.skipped:
        out.skipped["not_for_index"] += batch.skipped
    for event in batch.events:
        if isinstance(event, AllBlocksCleared):
            out.events.append(ClearSource())
            continue
        if event.group_idx != 0:
            out.skipped["group"] += 1
            continue
        tier = MEDIUM_TIERS.get(event.medium)
        if tier is None:
            out.skipped["medium"] += 1
            continue
        if isinstance(event, BlockRemoved):
            out.events.append(RemoveBlocks(hashes=event.block_hashes, tier=tier))
            continue
        store = _store(event, model, tier)
        if store is None:
            out.skipped["extra_keys"] += 1
        else:
            out.events.append(store)
    return out


def _store(event: BlockStored, model: str, tier: Tier) -> StoreBlocks | None:
    if not _extra_keys_keyable(event.extra_keys, event.cache_salt):
        return None
    lora = event.lora_name
    if lora is None and event.lora_id is not None:
        lora = f"#lora-id:{event.lora_id}"
    return StoreBlocks(
        hashes=event.block_hashes,
        parent=event.parent_block_hash,
        token_ids=event.token_ids,
        block_size=event.block_size,
        tier=tier,
        namespace=namespace(model, lora, event.cache_salt),
    )
