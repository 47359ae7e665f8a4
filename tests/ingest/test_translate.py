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
            _store(extra_keys=[[["mm-hash", 0]]]),
            _store(extra_keys=[["salt"]], cache_salt="salt"),
        ],
        skipped=2,
    )
    out = translate(batch, "m")
    assert len(out.events) == 1
    assert out.skipped == {"medium": 1, "group": 2, "extra_keys": 1, "not_for_index": 2}


def _two_blocks(**kw: object) -> BlockStored:
    return _store(block_hashes=[H(1), H(2)], token_ids=list(range(8)), **kw)


def test_vllm_extra_keys_name_the_namespace() -> None:
    """vLLM 0.33: the LoRA name on every block, the salt on the request's first only."""
    batch = EventBatch(
        ts=0.0,
        events=[
            _two_blocks(lora_name="ad", extra_keys=[["ad", "s"], ["ad"]]),
            _two_blocks(extra_keys=[["s"], None]),
            _two_blocks(lora_name="ad", extra_keys=[["ad"], ["ad"]]),
            _two_blocks(lora_id=3, extra_keys=[[3], [3]]),
        ],
    )
    out = translate(batch, "m")
    assert [e.namespace for e in out.events if isinstance(e, StoreBlocks)] == [
        root_key("m", "ad", "s"),
        root_key("m", None, "s"),
        root_key("m", "ad"),
        root_key("m", "#lora-id:3"),
    ]
    assert not out.skipped


def test_blocks_before_the_first_multimodal_or_embeds_block_are_kept() -> None:
    out = translate(
        EventBatch(
            ts=0.0,
            events=[
                _two_blocks(extra_keys=[["s"], [["image", 3]]]),
                _two_blocks(extra_keys=[[b"digest"], [b"digest"]]),
            ],
        ),
        "m",
    )
    (store,) = out.events
    assert isinstance(store, StoreBlocks)
    assert (list(store.hashes), list(store.token_ids)) == ([H(1)], [0, 1, 2, 3])
    assert store.namespace == root_key("m", None, "s")
    assert out.skipped == {"extra_keys": 2}


def test_malformed_extra_keys_skip_the_store_whole() -> None:
    malformed = [
        _two_blocks(extra_keys=[["s"]]),  # not one entry per block
        _two_blocks(extra_keys=[7, None]),  # an entry that is no list
        _two_blocks(extra_keys=[None, ["s"]]),  # a salt past the first block
        _two_blocks(parent_block_hash=H(9), extra_keys=[["s"], None]),  # … or past a parent
        _two_blocks(extra_keys=[["s", "t"], None]),  # two salts
        _two_blocks(extra_keys=[["s"], None], cache_salt="t"),  # a salt against the field
        _two_blocks(extra_keys=[[{"k": 1}], None]),  # an item of no known kind
        _two_blocks(extra_keys=[[["image", "3"]], None]),  # a pair whose offset is no int
        _two_blocks(lora_id=3, extra_keys=[[True], [3]]),  # a bool is no adapter id
    ]
    out = translate(EventBatch(ts=0.0, events=malformed), "m")
    assert out.events == []
    assert out.skipped == {"extra_keys_malformed": len(malformed)}


def test_an_old_bare_multimodal_hash_never_reaches_the_base_namespace() -> None:
    """Before vLLM published `(mm_identifier, offset)` pairs, a multimodal hash was a bare
    string, like a salt: on a first block it reads as one, elsewhere it is malformed."""
    out = translate(EventBatch(ts=0.0, events=[_two_blocks(extra_keys=[["mm"], ["mm"]])]), "m")
    assert out.events == []
    (store,) = translate(
        EventBatch(ts=0.0, events=[_two_blocks(extra_keys=[["mm"], None])]), "m"
    ).events
    assert isinstance(store, StoreBlocks)
    assert store.namespace not in (root_key("m"), root_key("m", None, ""))
