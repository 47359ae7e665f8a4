"""Every Redis key the index uses, named here and nowhere else (the scripts receive names).

Block keys (millions; short):
    {p}:b:{<chain's first key, hex>}<key, hex>   hash: generation -> tier mask under a
                                                  48-bit hash (redis_scripts.fingerprints),
                                                  "#" -> the sum of those fields
The hash tag is the chain's first block, so every key a lookup walks sits in one slot and
Redis Cluster shards by conversation root.

Per source (one generation per source life; a reset or clear starts a new one):
    {p}:index:sources          hash: "<pod>@<dp_rank>" -> current generation
    {p}:index:live             hash: generation -> "<pod>@<dp_rank>"; lookups trust only these
    {p}:index:dead             set: generations hidden, their blocks not yet dropped
    {p}:index:gen:next         counter of generation ids (never reused)
    {p}:index:gen:<g>:log      list: the reverse log, binary records of engine blocks
                               stored and deleted (see redis_scripts.py)
    {p}:index:gen:<g>:info     hash: that generation's statistics and batch count
    {p}:index:marker           string: dataset token; gone when Redis lost its data
    {p}:index:layout           string: `LAYOUT`, the version of every name and value above
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence

import redis.asyncio as aioredis

from globalkv.index.base import IndexUnavailable, Source
from globalkv.keys import BlockKey

_PREFIX_RE = re.compile(r"[A-Za-z0-9_.:-]+")

LAYOUT = b"2"
"""Bump with any change to the names or value formats above. Layout 1 is what came before
the key existed (generations without a `layout` key)."""


class LayoutMismatch(IndexUnavailable):
    """The prefix holds an index of another layout: reading it would give wrong answers.

    Unavailable rather than a crash, so a gateway routes by load and says why."""


class RedisKeys:
    __slots__ = (
        "block_prefix",
        "dead",
        "layout",
        "live",
        "marker",
        "next_gen",
        "prefix",
        "sources",
    )

    def __init__(self, prefix: str = "gkv") -> None:
        if not _PREFIX_RE.fullmatch(prefix):
            raise ValueError(
                f"redis key prefix {prefix!r} must be letters, digits and _.:- only "
                "(braces would break the hash tags)"
            )
        self.prefix = prefix
        self.block_prefix = f"{prefix}:b:"
        self.sources = f"{prefix}:index:sources"
        self.live = f"{prefix}:index:live"
        self.dead = f"{prefix}:index:dead"
        self.next_gen = f"{prefix}:index:gen:next"
        self.marker = f"{prefix}:index:marker"
        self.layout = f"{prefix}:index:layout"

    def block(self, root: BlockKey, key: BlockKey) -> str:
        return f"{self.block_prefix}{{{root:016x}}}{key:016x}"

    def chain(self, keys: Sequence[BlockKey]) -> tuple[str, str]:
        """A looked-up chain as (head, digits): key i is named head + digits[16i:16i+16].

        The same names as `block(keys[0], key)`, built once as one string, because a
        lookup sends hundreds of them and per-name formatting is most of its Python cost.
        """
        return f"{self.block_prefix}{{{keys[0]:016x}}}", struct.pack(f">{len(keys)}Q", *keys).hex()

    def log(self, gen: int) -> str:
        return f"{self.prefix}:index:gen:{gen}:log"

    def info(self, gen: int) -> str:
        return f"{self.prefix}:index:gen:{gen}:info"


async def check_layout(redis: aioredis.Redis, keys: RedisKeys) -> None:
    """Claim an empty prefix for `LAYOUT`, or raise `LayoutMismatch` if it holds another.

    A reader or writer of another layout does not fail by itself: it misreads (wrong
    depths, wrong pods) or corrupts. Not atomic (the keys span slots): two processes of
    different layouts starting on one empty prefix at the same instant are not caught.
    Redis errors pass through: callers turn them into `IndexUnavailable`.
    """
    found = await redis.get(keys.layout)
    if found is None:
        # Every writer of layout 1 set the dataset marker; writers since claim the layout
        # first. (Not `gen:next`: a refused write after a restart still increments it.)
        if await redis.exists(keys.marker, keys.sources):
            found = b"1"
        else:
            await redis.set(keys.layout, LAYOUT, nx=True)
            found = await redis.get(keys.layout)
    found = found.encode() if isinstance(found, str) else found
    if found not in (None, LAYOUT):
        raise LayoutMismatch(
            f"redis prefix {keys.prefix!r} holds an index of layout {found.decode()}, this "
            f"globalkv reads layout {LAYOUT.decode()}: run the same version everywhere, or "
            f"use another prefix (or delete its keys) for this one"
        )


def source_name(source: Source) -> str:
    return f"{source.pod}@{source.dp_rank}"


def parse_source_name(name: str) -> Source:
    pod, _, dp_rank = name.rpartition("@")
    return Source(pod, int(dp_rank))
