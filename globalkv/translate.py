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
- `extra_keys` (vLLM): one entry per block, untagged, in the order vLLM builds them
  (`generate_block_hash_extra_keys`, `to_event_extra_keys`): the LoRA name when the event
  names one, `(mm_identifier, offset)` pairs, the cache salt (a bare string, on the
  request's first block only) and prompt-embeds digests (bytes). The LoRA name and the
  salt name the chain's namespace, which a gateway derives from the request alike. A
  multimodal pair or an embeds digest makes its block depend on inputs a gateway cannot
  see: the blocks before the first such one are stored, the rest skipped (`extra_keys`);
  their children then count as orphans in the index, which is the truth. An entry that
  is none of these, or a salt anywhere but on the first block of a chain, is skipped
  whole (`extra_keys_malformed`): a malformed store is never applied in part.
- The salt on the first block only is enough: a later store of the same request names
  its parent, and the index continues the parent's chain, namespace included.
- SGLang names the namespace in fields: `lora_name` (the public adapter name) and
  `cache_salt`, on every store.
- LoRA: `lora_name` when given; an old event with only a `lora_id` gets a namespace no
  request can produce (`#lora-id:N`), so it never collides with the base model.
- Older vLLM published a multimodal hash as a bare string: on a chain's first block it
  reads as a salt, a namespace only a request carrying that exact hash as its salt
  reaches; anywhere else it is malformed. Neither gives a false hit.
"""

from __future__ import annotations

from collections import Counter
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


@dataclass(frozen=True, slots=True)
class _ExtraKeys:
    cache_salt: str | None
    keyable: int
    """Leading blocks whose hash depends on nothing but tokens, LoRA and salt."""


def _read_extra_keys(event: BlockStored) -> _ExtraKeys | None:
    """The salt and keyable blocks `event.extra_keys` tell; None when they are malformed."""
    entries = event.extra_keys
    salt = event.cache_salt
    count = len(event.block_hashes)
    if not entries:
        return _ExtraKeys(salt, count)
    if len(entries) != count:
        return None
    keyable = count
    for position, entry in enumerate(entries):
        if entry is None:
            continue
        if not isinstance(entry, list | tuple):
            return None
        items = list(entry)
        if items and _names_lora(items[0], event):
            items = items[1:]
        salted = False
        for item in items:
            if isinstance(item, str):
                first_of_chain = position == 0 and event.parent_block_hash is None
                if salted or not first_of_chain or salt not in (None, item):
                    return None
                salt, salted = item, True
            elif isinstance(item, bytes) or _multimodal(item):
                keyable = min(keyable, position)
            else:
                return None
    return _ExtraKeys(salt, keyable)


def _names_lora(item: object, event: BlockStored) -> bool:
    """vLLM puts the adapter first: its name, or its id in versions before `lora_name`."""
    if event.lora_name is not None:
        return item == event.lora_name
    return event.lora_id is not None and type(item) is int and item == event.lora_id


def _multimodal(item: object) -> bool:
    """An `(mm_identifier, offset)` pair."""
    return (
        isinstance(item, list | tuple)
        and len(item) == 2
        and isinstance(item[0], str | bytes)
        and type(item[1]) is int
    )


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
        extra = _read_extra_keys(event)
        if extra is None:
            out.skipped["extra_keys_malformed"] += 1
            continue
        if extra.keyable < len(event.block_hashes):
            out.skipped["extra_keys"] += 1
        if extra.keyable:
            out.events.append(_store(event, model, tier, extra))
    return out


def _store(event: BlockStored, model: str, tier: Tier, extra: _ExtraKeys) -> StoreBlocks:
    lora = event.lora_name
    if lora is None and event.lora_id is not None:
        lora = f"#lora-id:{event.lora_id}"
    hashes, tokens = event.block_hashes, event.token_ids
    if extra.keyable < len(hashes):
        hashes, tokens = hashes[: extra.keyable], tokens[: extra.keyable * event.block_size]
    return StoreBlocks(
        hashes=hashes,
        parent=event.parent_block_hash,
        token_ids=tokens,
        block_size=event.block_size,
        tier=tier,
        namespace=namespace(model, lora, extra.cache_salt),
    )
