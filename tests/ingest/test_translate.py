from __future__ import annotations

from globalkv.index.base import ClearSource, RemoveBlocks, StoreBlocks, Tier
from globalkv.keys import EngineHash, root_key
from globalkv.translate import translate
from globalkv.wire import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

H = EngineHash


def _store(**kw: object) -> BlockStored:
    fields: dict[str, object] = {
        "block_hashes": [H(1)],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": 4,
    }
    fields.update(kw)
    return BlockStored(**fields)  # type: ignore[arg-type]


def test_events_map_to_index_events_with_namespace_and_tier() -> None:
    batch = EventBatch(
        ts=1.0,
        events=[
            _store(medium="CPU_PINNED", lora_name="ad", cache_salt="s"),
            BlockRemoved(block_hashes=[H(1)], medium="STORAGE"),
            AllBlocksCleared(),
        ],
    )
    out = translate(batch, "m")
    store, remove, clear = out.events
    assert isinstance(store, StoreBlocks)
    assert store.tier is Tier.CPU
    assert store.namespace == root_key("m", "ad", "s")
    assert remove == RemoveBlocks(hashes=[H(1)], tier=Tier.DISK)
    assert clear == ClearSource()
    assert not out.skipped


def test_no_medium_is_gpu_and_the_base_namespace() -> None:
    (store,) = translate(EventBatch(ts=0.0, events=[_store()]), "m").events
    assert isinstance(store, StoreBlocks)
    assert store.tier is Tier.GPU
    assert store.namespace == root_key("m")


def test_lora_id_without_name_never_matches_the_base_model() -> None:
    (store,) = translate(EventBatch(ts=0.0, events=[_store(lora_id=3)]), "m").events
    assert isinstance(store, StoreBlocks)
    assert store.namespace not in (root_key("m"), root_key("m", "3"))


def test_unkeyable_events_are_skipped_by_reason() -> None:
    batch = EventBatch(
        ts=0.0,
        events=[
            _store(medium="TAPE"),
            _store(group_idx=1),
            BlockRemoved(block_hashes=[H(1)], group_idx=2),
            _store(extra_keys=[["mm-hash"]]),
            _store(extra_keys=[["salt"], None], cache_salt="salt"),
        ],
        skipped=2,
    )
    out = translate(batch, "m")
    assert len(out.events) == 1
    assert out.skipped == {"medium": 1, "group": 2, "extra_keys": 1, "not_for_index": 2}
