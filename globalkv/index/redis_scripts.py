"""The Lua scripts of the Redis index and the values Python and Lua exchange.

Scripts are package files (`redis_*.lua`), run by SHA and loaded again when Redis lost
them (a restart, SCRIPT FLUSH). The values: engine blocks packed for the reverse hash, and
the fingerprint contributions that let the lookup script skip unchanged blocks.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from importlib.resources import files
from typing import Any

import redis.asyncio as aioredis
import xxhash
from redis import exceptions as redis_errors

from globalkv.index.scoring import ALL_TIERS
from globalkv.index.state import EngineBlock
from globalkv.keys import BlockKey

HASH = struct.Struct("<Q")
"""An engine hash as a reverse-hash field."""


class Script:
    """A Lua file of this package, run by SHA and loaded again when Redis lost it."""

    def __init__(self, filename: str) -> None:
        self.source = (files("globalkv.index") / filename).read_bytes()
        self.sha = hashlib.sha1(self.source).hexdigest()

    async def run(self, client: aioredis.Redis, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except redis_errors.NoScriptError:
            await client.script_load(self.source)
            return await client.evalsha(self.sha, len(keys), *keys, *args)


LOOKUP = Script("redis_lookup.lua")
APPLY = Script("redis_apply.lua")
DROP = Script("redis_drop.lua")


def fingerprints(gen: int) -> tuple[int, ...]:
    """Per tier mask (index), the fingerprint contribution of generation `gen` holding a key."""
    digest = xxhash.xxh3_64_intdigest
    return (0, *(digest(f"{gen}:{mask}".encode()) >> 16 for mask in range(1, ALL_TIERS + 1)))


def pack_block(block: EngineBlock) -> bytes:
    return struct.pack(f"<BQ{len(block.keys)}Q", block.tiers, block.root, *block.keys)


def unpack_block(raw: bytes) -> EngineBlock:
    count, rest = divmod(len(raw) - 9, 8)
    if count <= 0 or rest:
        raise ValueError(f"packed engine block of {len(raw)} bytes")
    tiers, root, *keys = struct.unpack(f"<BQ{count}Q", raw)
    return EngineBlock(tuple(BlockKey(k) for k in keys), BlockKey(root), tiers)
