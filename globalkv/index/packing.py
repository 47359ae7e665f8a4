"""An engine block packed into one int, the form every per-block map of a source uses.

Nothing per block is an object the garbage collector tracks: an indexer holds millions of
blocks, and one tuple per block made every full collection walk all of them (45-60 ms
pauses in lookups). So an engine block is one int: its tiers, chain root and last key,
plus its other keys when it spans several index blocks. `EngineBlock` is the unpacked
form, for the reverse log and for readers that are not on the hot path.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from globalkv.index.base import Tier
from globalkv.keys import BlockKey

TIER_BITS: tuple[int, ...] = tuple(int(t) for t in Tier)
KEY_MASK = (1 << 64) - 1
ROOT_AT = 3
LAST_AT = 67
REST_AT = 131


class EngineBlock(NamedTuple):
    """One engine block, unpacked: what the Redis reverse log records."""

    keys: tuple[BlockKey, ...]
    root: BlockKey
    """First key of the chain; Redis tags block keys with it so a chain shares a slot."""
    tiers: int


def pack_block(block: EngineBlock) -> int:
    """`tiers | root << 3 | last key << 67`, and for k > 1 keys the first k - 1 above bit
    131 under a marker bit (a key may be 0, so the marker tells how many there are)."""
    keys = block.keys
    word = block.tiers | block.root << ROOT_AT | keys[-1] << LAST_AT
    if len(keys) > 1:
        rest = struct.pack(f"<{len(keys) - 1}Q", *keys[:-1]) + b"\x01"
        word |= int.from_bytes(rest, "little") << REST_AT
    return word


def block_keys(word: int) -> tuple[BlockKey, ...]:
    last = BlockKey(word >> LAST_AT & KEY_MASK)
    rest = word >> REST_AT
    if not rest:
        return (last,)
    count = (rest.bit_length() - 1) // 64
    others = (rest ^ 1 << 64 * count).to_bytes(8 * count, "little")
    return (*struct.unpack(f"<{count}Q", others), last)


def unpack_block(word: int) -> EngineBlock:
    return EngineBlock(block_keys(word), BlockKey(word >> ROOT_AT & KEY_MASK), word & 7)
