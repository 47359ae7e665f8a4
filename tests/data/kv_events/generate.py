"""Writes `vllm-0.33.0.json` and `sglang-0.5.23.json`: KV events made by the engines' own code.

The tests replay these bytes (`tests/ingest/test_engine_golden.py`); nothing here runs in
the test suite. vLLM's block pool needs torch, and both engines need more than the
project installs, so the bytes are made once, in a separate virtual environment holding
vLLM 0.33.0, SGLang 0.5.23, a CPU torch and their imports, and checked in:

    python tests/data/kv_events/generate.py

Each case is one request as the engine caches it: vLLM's `BlockPool.cache_full_blocks`
and `emit_cached_block_events` (the events `vllm/v1/core/block_pool.py` queues, encoded
by msgspec as `ZmqEventPublisher` encodes them); SGLang's `KVCacheEventRecorder.record_store`
over radix-tree nodes as `sglang/srt/mem_cache/radix_cache.py` inserts them, encoded the
same way. Tokens are 16 per block, the prompt `PROMPT`, the served model `MODEL`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import msgspec

HERE = Path(__file__).parent
MODEL = "golden-model"
BLOCK = 16
PROMPT = list(range(1000, 1064))
"""Four blocks: every case stores the same tokens, each in its own namespace."""
TAIL = list(range(2000, 2032))
"""Two more blocks a salted request adds in a later step, chained on its parent."""


def _vllm_cases() -> dict[str, Any]:
    import torch
    from vllm.distributed.kv_events import KVEventBatch
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(BLOCK, sha256_cbor)
    pool = BlockPool(
        num_gpu_blocks=256, enable_caching=True, hash_block_size=BLOCK, enable_kv_cache_events=True
    )
    adapter = LoRARequest("adapter-a", 1, "/adapters/a")
    encoder = msgspec.msgpack.Encoder()
    counter = iter(range(1_000_000))

    def request(tokens: list[int], **kw: Any) -> Request:
        return Request(
            request_id=f"r{next(counter)}",
            prompt_token_ids=tokens,
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            block_hasher=hasher,
            **kw,
        )

    def cache(req: Request, start: int, end: int, blocks: list[Any]) -> None:
        pool.cache_full_blocks(req, blocks, start, end, BLOCK, 0)

    def batch() -> str:
        events = pool.take_events()
        payload: bytes = encoder.encode(KVEventBatch(ts=1.5, events=events, data_parallel_rank=0))
        return payload.hex()

    cases: dict[str, Any] = {}

    def simple(name: str, tokens: list[int], what: str, **kw: Any) -> None:
        req = request(tokens, **kw)
        cache(req, 0, len(tokens) // BLOCK, pool.get_new_blocks(len(tokens) // BLOCK))
        cases[name] = {"what": what, "batches": [batch()]}

    simple("base", PROMPT, "the base model's prompt")
    simple("lora", PROMPT, "the same tokens for LoRA adapter-a", lora_request=adapter)
    simple("salt", PROMPT, "the same tokens salted tenant-1", cache_salt="tenant-1")
    simple(
        "lora_salt",
        PROMPT,
        "the same tokens for adapter-a salted tenant-1",
        lora_request=adapter,
        cache_salt="tenant-1",
    )
    # A salted request cached in two steps: the second store names its parent and
    # carries no salt, as vLLM caches a long prompt chunk by chunk.
    tokens = PROMPT + TAIL
    req = request(tokens, cache_salt="tenant-2")
    blocks = pool.get_new_blocks(len(tokens) // BLOCK)
    cache(req, 0, 4, blocks)
    first = batch()
    cache(req, 4, 6, blocks)
    cases["salt_two_steps"] = {
        "what": "PROMPT + TAIL salted tenant-2, cached 4 blocks then 2",
        "batches": [first, batch()],
    }
    # The same salted prompt again: vLLM re-emits its prefix-cache hit, from block 0.
    again = request(tokens, cache_salt="tenant-2")
    pool.emit_cached_block_events(again, 6, BLOCK, 0)
    cases["salt_cached_again"] = {
        "what": "PROMPT + TAIL salted tenant-2 again, its hit re-emitted",
        "batches": [batch()],
    }
    image = MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier="image-hash-1",
        mm_position=PlaceholderRange(offset=40, length=8),
    )
    simple(
        "multimodal",
        list(range(3000, 3064)),
        "an image at tokens 40-47: blocks 0-1 hash tokens only, block 2 the image",
        mm_features=[image],
    )
    embeds = request(
        list(range(4000, 4032)), prompt_embeds=torch.arange(32 * 4, dtype=torch.float32).view(32, 4)
    )
    cache(embeds, 0, 2, pool.get_new_blocks(2))
    cases["prompt_embeds"] = {"what": "a prompt given as embeddings", "batches": [batch()]}
    # The LoRA request's last blocks evicted (the "lora" case's hashes: one process).
    lora = request(PROMPT, lora_request=adapter)
    held = pool.get_new_blocks(4)
    cache(lora, 0, 4, held)
    pool.take_events()
    pool.free_blocks(held)
    pool.evict_blocks({b.block_id for b in held[2:]})
    cases["removed"] = {"what": "adapter-a's last two blocks evicted", "batches": [batch()]}
    return cases


def _sglang_cases() -> dict[str, Any]:
    from sglang.srt.disaggregation.kv_events import KVEventBatch
    from sglang.srt.mem_cache.events import KVCacheEventRecorder, KvEventLoraNames

    encoder = msgspec.msgpack.Encoder()
    names = KvEventLoraNames()

    class Key:
        def __init__(self, tokens: list[int], extra_key: str | None, salt: str | None) -> None:
            self.token_ids = tokens
            self.extra_key = extra_key
            self.cache_salt = salt
            self.is_bigram = False

        def __len__(self) -> int:
            return len(self.token_ids)

    class Node:
        def __init__(self, key: Key, parent: Node | None) -> None:
            self.key = key
            self.parent = parent
            self.hash_value: list[str] | None = None
            self.event_hash_value: list[str] | None = None

    class Req:
        def __init__(self, extra_key: str | None, lora_id: str | None) -> None:
            self.extra_key = extra_key
            self.lora_id = lora_id

    lora_id = "0" * 31 + "1"
    names.register(lora_name="adapter-a", lora_id=lora_id)  # the adapter, as it is loaded
    names.register(Req(lora_id, lora_id))  # a request's namespace, as it is admitted

    def store(tokens: list[int], extra_key: str | None, salt: str | None) -> str:
        collector = KVCacheEventRecorder(enabled=True, page_size=BLOCK, lora_names=names)
        root = Node(Key([], None, None), None)
        node = Node(Key(tokens, extra_key, salt), root)
        collector.record_store(node)
        payload: bytes = encoder.encode(
            KVEventBatch(ts=1.5, events=collector.take(), attn_dp_rank=0)
        )
        return payload.hex()

    return {
        "base": {"what": "the base model's prompt", "batches": [store(PROMPT, None, None)]},
        "lora": {
            "what": "the same tokens for LoRA adapter-a (its lora_id ends the extra key)",
            "batches": [store(PROMPT, lora_id, None)],
        },
        "salt": {
            "what": "the same tokens salted tenant-1",
            "batches": [store(PROMPT, None, "tenant-1")],
        },
        "lora_salt": {
            "what": "the same tokens for adapter-a salted tenant-1",
            "batches": [store(PROMPT, lora_id, "tenant-1")],
        },
    }


def main() -> None:
    from importlib.metadata import version

    for engine, cases in (("vllm", _vllm_cases), ("sglang", _sglang_cases)):
        out = {
            "engine": engine,
            "version": version(engine),
            "model": MODEL,
            "block_size": BLOCK,
            "prompt": PROMPT,
            "tail": TAIL,
            "made_by": "tests/data/kv_events/generate.py",
            "cases": cases(),
        }
        path = HERE / f"{engine}-{out['version']}.json"
        path.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
