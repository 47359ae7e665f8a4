"""Our own block keys, computed the same way from engine events and from request tokens.

Engine hashes cannot be recomputed outside the engine (seeded, versioned, per engine), so
the indexer and the gateway both derive a chained 64-bit key per index block:

    key_root = xxh3_64(namespace)       namespace = model, LoRA name, cache salt
    key_i    = xxh3_64(key_{i-1} as 8 bytes LE || block tokens as u32 LE)

A key therefore names the whole prefix up to and including its block. Partial blocks are
never keyed: two prompts that share a partial block share nothing cacheable.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence
from typing import NewType

import xxhash

BlockKey = NewType("BlockKey", int)
"""One of our keys: an unsigned 64-bit int naming a prefix of whole index blocks."""

EngineHash = NewType("EngineHash", int)
"""An engine's block hash, normalised to an unsigned 64-bit int (see globalkv.wire)."""

_NAMESPACE_SEP = "\x1f"
_TOKEN_MAX = 0xFFFFFFFF


def root_key(model: str, lora_name: str | None = None, cache_salt: str | None = None) -> BlockKey:
    """The chain's starting point, so equal tokens under different adapters never collide."""
    namespace = _NAMESPACE_SEP.join((model, lora_name or "", cache_salt or ""))
    return BlockKey(xxhash.xxh3_64_intdigest(namespace.encode()))


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Tokens as u32 little-endian, the byte form every key is computed over."""
    try:
        packed = array("I", tokens)
    except OverflowError as exc:
        raise ValueError(f"token ids must be in [0, {_TOKEN_MAX}]") from exc
    if packed.itemsize != 4:  # pragma: no cover - platforms where C unsigned int is not 32-bit
        return struct.pack(f"<{len(tokens)}I", *tokens)
    if struct.pack("=I", 1) != struct.pack("<I", 1):  # pragma: no cover - big-endian hosts
        packed.byteswap()
    return packed.tobytes()


def chain_keys(parent: BlockKey, tokens: Sequence[int] | bytes, block_size: int) -> list[BlockKey]:
    """Keys of every whole block of `tokens`, chained from `parent`; a partial tail is dropped.

    `tokens` may be given as ids or already packed by `token_bytes` (callers that key the
    same prompt at several offsets pack once).
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    data = tokens if isinstance(tokens, bytes) else token_bytes(tokens)
    stride = block_size * 4
    digest = xxhash.xxh3_64_intdigest
    keys: list[int] = []
    append = keys.append
    prev: int = parent
    # The hot loop of every lookup: plain ints and local names (BlockKey is an int at run
    # time, so the list needs no per-key conversion).
    for start in range(0, len(data) - stride + 1, stride):
        prev = digest(prev.to_bytes(8, "little") + data[start : start + stride])
        append(prev)
    return keys  # type: ignore[return-value]


def request_keys(
    tokens: Sequence[int],
    block_size: int,
    model: str,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> list[BlockKey]:
    """The key chain a gateway looks up for a prompt."""
    return chain_keys(root_key(model, lora_name, cache_salt), tokens, block_size)
