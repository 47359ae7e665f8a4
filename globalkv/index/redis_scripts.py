"""The Lua scripts of the Redis index and the values Python and Lua exchange.

Scripts are package files (`redis_*.lua`), run by SHA and loaded again when Redis lost
them (a restart, SCRIPT FLUSH). The values: records of the reverse log, and the
block fields whose sum lets the lookup script skip unchanged blocks.

Reverse data is a log per generation: one Redis list entry per batch, holding binary
records (an engine block stored, or deleted), replayed in order to rebuild a writer's
state or to name the keys of a retired generation. One entry per batch costs Redis a
single RPUSH where a hash field per engine block cost a field each, and the records are
about a third of a hash field's size. The writer replaces the log with a snapshot of its
state once the log outgrows it, so the log stays within a small factor of what is held.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Iterator, Sequence
from importlib.resources import files
from typing import Any

import xxhash
from redis import exceptions as redis_errors

from globalkv.index.packing import EngineBlock
from globalkv.index.scoring import ALL_TIERS
from globalkv.keys import BlockKey, EngineHash
from globalkv.redis_client import Client


class Script:
    """A Lua file of this package, run by SHA and loaded again when Redis lost it."""

    def __init__(self, filename: str) -> None:
        self.source = (files("globalkv.index") / filename).read_bytes()
        self.sha = hashlib.sha1(self.source).hexdigest()

    async def run(self, client: Client, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except redis_errors.NoScriptError:
            await client.script_load(self.source)
            return await client.evalsha(self.sha, len(keys), *keys, *args)


LOOKUP = Script("redis_lookup.lua")
APPLY = Script("redis_apply.lua")
DROP = Script("redis_drop.lua")
RETIRE_POD = Script("redis_retire_pod.lua")
FENCE_COPY = Script("redis_fence_copy.lua")
FENCE_RELEASE = Script("redis_fence_release.lua")


def fingerprints(gen: int) -> tuple[int, ...]:
    """Per tier mask (index), what generation `gen` holding a key stores in the key's hash.

    A 48-bit hash of (generation, mask) whose low 3 bits are the mask: the key's "#" is the
    sum of its fields, so a lookup that sees "#" drop by exactly one holder's value between
    two blocks knows that holder's run ended there without reading the other holders.
    """
    digest = xxhash.xxh3_64_intdigest
    return (
        0,
        *(digest(f"{gen}:{mask}".encode()) >> 16 & ~7 | mask for mask in range(1, ALL_TIERS + 1)),
    )


_PUT = struct.Struct("<cQBQIH")
"""b"P", engine hash, tiers, chain root, position of the first key, key count; then the keys."""
_DELETE = struct.Struct("<cQ")
"""b"D", engine hash."""


def log_put(engine_hash: EngineHash, block: EngineBlock) -> bytes:
    count = len(block.keys)
    head = _PUT.pack(b"P", engine_hash, block.tiers, block.root, block.depth, count)
    return head + struct.pack(f"<{count}Q", *block.keys)


def log_delete(engine_hash: EngineHash) -> bytes:
    return _DELETE.pack(b"D", engine_hash)


def replay_log(entries: Iterable[bytes]) -> Iterator[tuple[EngineHash, EngineBlock | None]]:
    """The (engine hash, block or None for a delete) records of log entries, in order.

    Raises ValueError on a record that cannot be read.
    """
    try:
        yield from _records(entries)
    except struct.error as exc:
        raise ValueError(f"unreadable log record: {exc}") from exc


def _records(entries: Iterable[bytes]) -> Iterator[tuple[EngineHash, EngineBlock | None]]:
    for entry in entries:
        at, end = 0, len(entry)
        while at < end:
            if entry[at : at + 1] == b"D":
                _, engine_hash = _DELETE.unpack_from(entry, at)
                at += _DELETE.size
                yield EngineHash(engine_hash), None
                continue
            tag, engine_hash, tiers, root, depth, count = _PUT.unpack_from(entry, at)
            if tag != b"P":
                raise ValueError(f"unknown log record {tag!r}")
            at += _PUT.size
            if not count:
                raise ValueError("a stored block without keys")
            keys = struct.unpack_from(f"<{count}Q", entry, at)
            at += 8 * count
            block = EngineBlock(tuple(map(BlockKey, keys)), root, tiers, depth)
            yield EngineHash(engine_hash), block
