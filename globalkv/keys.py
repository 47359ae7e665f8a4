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
from collections.abc import Iterator, Sequence
from functools import lru_cache
from typing import NewType, overload

import xxhash

BlockKey = NewType("BlockKey", int)
"""One of our keys: an unsigned 64-bit int naming a prefix of whole index blocks."""

EngineHash = NewType("EngineHash", int)
"""An engine's block hash, normalised to an unsigned 64-bit int (see globalkv.wire)."""

_NAMESPACE_SEP = "\x1f"
_TOKEN_MAX = 0xFFFFFFFF
_SPLIT = 64
"""Blocks cut out of packed tokens per struct call."""


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
    return list(_hashed(parent, data, block_size))  # type: ignore[arg-type]


def _hashed(parent: int, data: bytes, block_size: int) -> Iterator[int]:
    """The hot loop of every lookup and every stored block: plain ints, local names, and
    blocks cut out by one struct call per `_SPLIT` of them (a slice per block cost more)."""
    digest = xxhash.xxh3_64_intdigest
    stride = block_size * 4
    blocks = len(data) // stride
    prev = parent
    for first in range(0, blocks, _SPLIT):
        for block in _splitter(stride, min(_SPLIT, blocks - first)).unpack_from(
            data, first * stride
        ):
            prev = digest(prev.to_bytes(8, "little") + block)
            yield prev


@lru_cache(maxsize=256)
def _splitter(stride: int, count: int) -> struct.Struct:
    """Cuts `count` blocks of `stride` bytes; a bounded set, unlike one format per length."""
    return struct.Struct(f"{stride}s" * count)


class KeyChain(Sequence[BlockKey]):
    """A prompt's key chain that a walk can hash only as far as it reads.

    A lookup ends at the first block no source holds, and a prompt's tail is usually new
    (the turn being asked), so a walk over `hashed()` never computes the keys past the last
    held block. The tokens are packed at once, which also validates all of them: an id
    outside u32 fails here, wherever it is. As a plain sequence, the chain is hashed whole
    on first use and kept.
    """

    __slots__ = ("_data", "_keys", "block_size", "parent")

    def __init__(self, parent: BlockKey, tokens: Sequence[int] | bytes, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.parent = parent
        self.block_size = block_size
        self._data = tokens if isinstance(tokens, bytes) else token_bytes(tokens)
        self._keys: list[BlockKey] | None = None

    def hashed(self) -> Iterator[BlockKey]:
        """The keys in order, each hashed when it is read."""
        return _hashed(self.parent, self._data, self.block_size)  # type: ignore[return-value]

    def __len__(self) -> int:
        return len(self._data) // (self.block_size * 4)

    def __iter__(self) -> Iterator[BlockKey]:
        return iter(self._all())

    @overload
    def __getitem__(self, index: int) -> BlockKey: ...
    @overload
    def __getitem__(self, index: slice) -> list[BlockKey]: ...
    def __getitem__(self, index: int | slice) -> BlockKey | list[BlockKey]:
        return self._all()[index]

    def _all(self) -> list[BlockKey]:
        if self._keys is None:
            self._keys = list(self.hashed())
        return self._keys


def request_keys(
    tokens: Sequence[int],
    block_size: int,
    model: str,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> list[BlockKey]:
    """The key chain a gateway looks up for a prompt."""
    return chain_keys(root_key(model, lora_name, cache_salt), tokens, block_size)


def request_chain(
    tokens: Sequence[int],
    block_size: int,
    model: str,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> KeyChain:
    """`request_keys`, hashed lazily: what a lookup that may stop early should take."""
    return KeyChain(root_key(model, lora_name, cache_salt), tokens, block_size)
