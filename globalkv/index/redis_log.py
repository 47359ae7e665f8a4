"""A generation's reverse log in Redis: read back to rebuild a writer, or to drop the
blocks of a retired generation (named by the log, never found by SCAN/KEYS); and the
retirement of a removed pod's generations."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any, cast

from globalkv.index.packing import place
from globalkv.index.redis_keys import RedisKeys
from globalkv.index.redis_scripts import DROP, RETIRE_POD, replay_log
from globalkv.index.redis_shards import Shards
from globalkv.redis_client import text

log = logging.getLogger(__name__)
_DROP_CHUNK = 1000
"""Block keys per call of the drop script."""
_LOG_READ = 64
"""Log entries per LRANGE when replaying a log."""


async def retire_pod(client: Any, keys: RedisKeys, pod: str) -> list[str]:
    """Hide every source of `pod` in one script: their generations retired, the sources
    forgotten. The source names retired."""
    names = await RETIRE_POD.run(client, (keys.sources, keys.live, keys.dead), (pod,))
    return [text(name) for name in names]


async def read_log(client: Any, keys: RedisKeys, gen: int) -> AsyncIterator[list[bytes]]:
    """A generation's reverse log, a few entries at a time."""
    key, start = keys.log(gen), 0
    while True:
        # bytes: the index's client does not decode (RedisIndex checks)
        entries = cast(list[bytes], await client.lrange(key, start, start + _LOG_READ - 1))
        if entries:
            yield entries
        if len(entries) < _LOG_READ:
            return
        start += _LOG_READ


async def drop_generation(client: Any, keys: RedisKeys, shards: Shards, gen: int) -> None:
    """Drop a retired generation's blocks, in chunks, then the generation itself."""
    slots: list[int] = []
    names: list[str] = []
    async for entries in read_log(client, keys, gen):
        try:
            for _, block in replay_log(entries):
                if block is None:
                    continue
                at = place(block.root, block.depth)
                for i, key in enumerate(block.keys):
                    slots.append(keys.block_slot(at + i))
                    names.append(keys.block(at + i, key))
        except ValueError as exc:  # what it named is kept: it cannot be found any more
            log.error("retired generation %d has a corrupt reverse log: %s", gen, exc)
        if len(names) >= _DROP_CHUNK:
            await _drop_blocks(client, shards, gen, slots, names)
            slots, names = [], []
    if names:
        await _drop_blocks(client, shards, gen, slots, names)
    pipe = client.pipeline(transaction=True)
    pipe.delete(keys.log(gen), keys.info(gen))
    pipe.srem(keys.dead, gen)
    await pipe.execute()


async def _drop_blocks(
    client: Any, shards: Shards, gen: int, slots: list[int], names: list[str]
) -> None:
    """The drop script per master (names repeat across log entries: sent once)."""
    unique = dict(zip(names, slots, strict=True))
    groups = shards.group(list(unique.values()), list(unique))
    await shards.gather(*(DROP.run(client, (g[0],), [gen, *g]) for g in groups))
