"""KV events made by vLLM 0.33.0's and SGLang 0.5.23's own code, replayed through the border.

The bytes were made by the engines' functions (`tests/data/kv_events/generate.py`, which
says how) and are checked in: vLLM's block pool needs torch, which the project does not
install. Each case is one request's stores; the index they build is looked up with the
namespace a gateway derives from the request, so a hit here is a hit a client gets.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from globalkv.index.base import Source, SourceBatch, StoreBlocks
from globalkv.index.memory import MemoryIndex
from globalkv.lookup import IndexLookup
from globalkv.translate import translate
from globalkv.wire import decode_batch, encode_batch

DATA = Path(__file__).parent.parent / "data" / "kv_events"
VLLM = "vllm-0.33.0.json"
SGLANG = "sglang-0.5.23.json"


@cache
def golden(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DATA / name).read_text())
    return data


def payloads(name: str, case: str) -> list[bytes]:
    return [bytes.fromhex(b) for b in golden(name)["cases"][case]["batches"]]


async def index_of(name: str, *cases: str) -> IndexLookup:
    data = golden(name)
    index = MemoryIndex(data["block_size"])
    seq = 0
    for case in cases:
        for payload in payloads(name, case):
            out = translate(decode_batch(payload), data["model"])
            await index.apply(SourceBatch(Source("pod-a"), seq, 0.0, out.events))
            seq += 1
    return IndexLookup(index)


async def hit(
    lookup: IndexLookup, tokens: Sequence[int], lora: str | None = None, salt: str | None = None
) -> int:
    result = await lookup.lookup(golden(VLLM)["model"], tokens, lora, salt)
    return max((p.hit_blocks for p in result.pods), default=0)


PROMPT: list[int] = golden(VLLM)["prompt"]
TAIL: list[int] = golden(VLLM)["tail"]


@pytest.mark.parametrize("name", [VLLM, SGLANG])
@pytest.mark.parametrize(
    ("case", "lora", "salt"),
    [
        ("base", None, None),
        ("lora", "adapter-a", None),
        ("salt", None, "tenant-1"),
        ("lora_salt", "adapter-a", "tenant-1"),
    ],
)
async def test_each_namespace_hits_only_itself(
    name: str, case: str, lora: str | None, salt: str | None
) -> None:
    lookup = await index_of(name, case)
    namespaces = [(None, None), ("adapter-a", None), (None, "tenant-1"), ("adapter-a", "tenant-1")]
    for other_lora, other_salt in [*namespaces, ("adapter-b", None), (None, "tenant-9")]:
        expected = 4 if (other_lora, other_salt) == (lora, salt) else 0
        assert await hit(lookup, PROMPT, other_lora, other_salt) == expected, (
            other_lora,
            other_salt,
        )


async def test_a_salted_chain_continued_in_a_later_store_keeps_its_salt() -> None:
    """vLLM puts the salt on the request's first block only; the second store names its
    parent, whose namespace the index continues."""
    lookup = await index_of(VLLM, "salt_two_steps")
    assert await hit(lookup, PROMPT + TAIL, salt="tenant-2") == 6
    assert await hit(lookup, PROMPT + TAIL) == 0
    assert await hit(lookup, PROMPT + TAIL, salt="tenant-1") == 0


async def test_a_reemitted_prefix_hit_carries_the_salt_again() -> None:
    lookup = await index_of(VLLM, "salt_cached_again")
    assert await hit(lookup, PROMPT + TAIL, salt="tenant-2") == 6
    assert await hit(lookup, PROMPT + TAIL) == 0


async def test_an_adapter_s_evicted_blocks_leave_its_namespace() -> None:
    lookup = await index_of(VLLM, "lora", "removed")
    assert await hit(lookup, PROMPT, "adapter-a") == 2
    assert await hit(lookup, PROMPT) == 0


def test_multimodal_blocks_are_skipped_from_the_first_image_block() -> None:
    data = golden(VLLM)
    (payload,) = payloads(VLLM, "multimodal")
    out = translate(decode_batch(payload), data["model"])
    (store,) = out.events
    assert isinstance(store, StoreBlocks)
    assert len(store.hashes) == 2  # blocks 0-1; the image starts in block 2
    assert len(store.token_ids) == 2 * data["block_size"]
    assert out.skipped == {"extra_keys": 1}


def test_prompt_embeds_are_never_keyed() -> None:
    (payload,) = payloads(VLLM, "prompt_embeds")
    out = translate(decode_batch(payload), golden(VLLM)["model"])
    assert out.events == []
    assert out.skipped == {"extra_keys": 1}


@pytest.mark.parametrize(
    ("name", "flavor", "cases"),
    [
        (VLLM, "vllm", ["base", "lora", "salt", "lora_salt", "salt_two_steps", "removed"]),
        (SGLANG, "sglang", ["base", "lora", "salt", "lora_salt"]),
    ],
)
def test_the_emulated_engines_publish_the_engines_bytes(
    name: str, flavor: Any, cases: list[str]
) -> None:
    """What `globalkv.wire.encode_batch` writes for a decoded batch is the engine's own
    payload, byte for byte: the emulator publishes what the indexer meets in production."""
    for case in cases:
        for payload in payloads(name, case):
            assert encode_batch(decode_batch(payload), flavor) == payload, case
