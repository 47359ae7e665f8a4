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
DEPTH_BITS = 32
DEPTH_MASK = (1 << DEPTH_BITS) - 1
DEPTH_AT = 3
ROOT_AT = DEPTH_AT + DEPTH_BITS
LAST_AT = ROOT_AT + 64
REST_AT = LAST_AT + 64


class EngineBlock(NamedTuple):
    """One engine block, unpacked: what the Redis reverse log records."""

    keys: tuple[BlockKey, ...]
    root: BlockKey
    """First key of the chain."""
    tiers: int
    depth: int
    """Position of `keys[0]` in its chain (the root is at 0). With the root it places a key
    (`place`): Redis spreads a chain over segments by position (redis_keys.py)."""


def place(root: int, depth: int) -> int:
    """A key's chain root and position as one int; the next key's place is `place + 1`."""
    return root << DEPTH_BITS | depth


def pack_block(block: EngineBlock) -> int:
    """`tiers | depth of the last key << 3 | root << 35 | last key << 99`, and for k > 1
    keys the first k - 1 above bit 163 under a marker bit (a key may be 0, so the marker
    tells how many there are)."""
    keys = block.keys
    last_depth = block.depth + len(keys) - 1
    word = block.tiers | last_depth << DEPTH_AT | block.root << ROOT_AT | keys[-1] << LAST_AT
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


def first_place(word: int, count: int) -> int:
    """The place of the first of a packed block's `count` keys."""
    return place(word >> ROOT_AT & KEY_MASK, (word >> DEPTH_AT & DEPTH_MASK) - count + 1)


def next_depth(word: int) -> int:
    """The position of a key chained from a packed block's last key."""
    return (word >> DEPTH_AT & DEPTH_MASK) + 1


def unpack_block(word: int) -> EngineBlock:
    keys = block_keys(word)
    depth = (word >> DEPTH_AT & DEPTH_MASK) - len(keys) + 1
    return EngineBlock(keys, BlockKey(word >> ROOT_AT & KEY_MASK), word & 7, depth)
