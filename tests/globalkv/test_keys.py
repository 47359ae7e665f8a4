"""Block keys: the one function the indexer and every gateway must compute identically."""

from __future__ import annotations

import struct

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from globalkv.keys import chain_keys, request_keys, root_key, token_bytes


def spelled_out(parent: int, tokens: list[int], block_size: int) -> list[int]:
    """The definition in `globalkv/keys.py`'s docstring, written as plainly as possible."""
    keys = []
    prev = parent
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start : start + block_size]
        prev = xxhash.xxh3_64_intdigest(
            struct.pack("<Q", prev) + struct.pack(f"<{block_size}I", *block)
        )
        keys.append(prev)
    return keys


def test_root_is_xxh3_of_the_namespace() -> None:
    assert root_key("m") == xxhash.xxh3_64_intdigest(b"m\x1f\x1f")
    assert root_key("m", "lora", "salt") == xxhash.xxh3_64_intdigest(b"m\x1flora\x1fsalt")


def test_golden_chain() -> None:
    """Pinned values: changing them breaks every deployed index and gateway together."""
    keys = request_keys(list(range(8)), 4, "m")
    assert keys == [499255105262207493, 5591326482807712212]
    assert keys == spelled_out(root_key("m"), list(range(8)), 4)


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=80),
    block_size=st.integers(1, 9),
    parent=st.integers(0, 2**64 - 1),
)
def test_chain_matches_the_definition(tokens: list[int], block_size: int, parent: int) -> None:
    assert chain_keys(parent, tokens, block_size) == spelled_out(parent, tokens, block_size)  # type: ignore[arg-type]


def test_partial_tail_is_never_keyed() -> None:
    root = root_key("m")
    assert chain_keys(root, list(range(7)), 4) == chain_keys(root, list(range(4)), 4)
    assert chain_keys(root, [1, 2, 3], 4) == []


def test_prepacked_bytes_give_the_same_keys() -> None:
    tokens = list(range(100, 164))
    root = root_key("m")
    assert chain_keys(root, token_bytes(tokens), 16) == chain_keys(root, tokens, 16)


def test_an_engine_block_of_k_index_blocks_continues_the_same_chain() -> None:
    root = root_key("m")
    tokens = list(range(64))
    first = chain_keys(root, tokens[:32], 16)
    assert chain_keys(first[-1], tokens[32:], 16) == chain_keys(root, tokens, 16)[2:]


def test_namespaces_separate_equal_tokens() -> None:
    tokens = list(range(16))
    assert request_keys(tokens, 16, "m") != request_keys(tokens, 16, "m", lora_name="a")
    assert request_keys(tokens, 16, "m", cache_salt="s") != request_keys(tokens, 16, "m")


@pytest.mark.parametrize("bad", [[-1], [2**32]])
def test_tokens_outside_u32_are_refused(bad: list[int]) -> None:
    with pytest.raises(ValueError, match="token ids"):
        chain_keys(root_key("m"), bad, 1)


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size"):
        chain_keys(root_key("m"), [1], 0)
