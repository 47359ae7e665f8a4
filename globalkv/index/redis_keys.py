"""Every Redis key and channel globalkv uses, named here and nowhere else (scripts receive
names): the index's, and those of the pod registry, the indexers' leases and the gateway
replicas, which share the index's prefix (so one prefix is one deployment) and, for the
registry and the leases, its hash tag (so their scripts run where the index checks them).

Block keys (millions; short):
    <prefix>:b:{<slot tag>}<key hex> hash: generation -> tier mask under a
                                     48-bit hash (redis_scripts.fingerprints), "#" -> their sum
A chain is cut into segments by position (`segment_of`: 16 blocks each for the first 256,
where the prompts of a deployment share their chat template and system prompt, 128 each
after); the blocks of one segment share a hash tag (one slot), so one script walks them.
Segment i of the chain rooted at r sits on slot `(r's top 14 bits + i * STRIDE) mod
16384`, named by `slot_tags`: consecutive segments land a golden-ratio fraction of the
slot ring apart, so on a cluster they fall on different masters, and the chat template
and system prompt every prompt starts with are spread over all masters instead of making
one slot hot. A lookup sends one script per master its segments touch (at most the
number of masters, concurrently).

Per source and the dataset (one generation per source life; a reset or clear starts a
new one), all under the hash tag `{p}`, one slot, so each write's checks are one script:
    {p}:index:sources          hash: "<pod>@<dp_rank>" -> current generation
    {p}:index:live             hash: generation -> "<pod>@<dp_rank>"; lookups trust only these
    {p}:index:dead             set: generations hidden, their blocks not yet dropped
    {p}:index:gen:next         counter of generation ids (never reused)
    {p}:index:gen:<g>:log      list: the reverse log, binary records of engine blocks
                               stored and deleted (see redis_scripts.py)
    {p}:index:gen:<g>:info     hash: that generation's statistics and batch count
    {p}:index:marker           string: dataset token; gone when Redis lost its data
    {p}:index:layout           string: `LAYOUT`, the version of every name and value above
(`{p}` is the prefix in braces: `{gkv}:index:live`; the names tagged by a slot start with
the bare prefix instead: `gkv:b:{265b}...`.)

The pod registry (`globalkv.registry`), same tag, so each of its writes is one script:
    {p}:registry:pods          hash: pod id -> PodInfo JSON
    {p}:registry:state         hash: pod id -> PodState JSON (only beside a listed pod)
    {p}:registry:marker        string: gone after a Redis restart or flush
    {p}:registry:changed       pub/sub channel: the id of a pod written or removed

Indexer replicas (`globalkv.ingest.leases`), same tag, so the apply script reads a fence
where it writes:
    {p}:lease:<pod>:owner      string: the holder's token, with the lease TTL
    {p}:lease:<pod>:fence      hash: token, counter, holder, last renewal
    {p}:indexers               sorted set: indexer id -> expiry

Gateway replicas (`gateway.replicas.shared_state`), under the bare prefix, one replica's load per
hash tag (a cluster spreads them):
    <prefix>:gateways          sorted set: replica -> expiry
    <prefix>:gw:{<replica>}:load  hash: worker -> its load as that replica sees it
    <prefix>:gw:{<replica>}:flow  hash: its flow control's tenants' usage, bands waiting,
                                  objectives active (gateway.replicas.shared_flow)
    <prefix>:gw:pending        pub/sub channel: pending prompts sent and answered

Per writer and slot, on a cluster (redis_checkpoints.py):
    <prefix>:ck:{<slot tag>}<writer> counter: the writer's block calls on that slot

Per pod, on a cluster with leases (redis_fences.py), in each of a fixed set of slots:
    <prefix>:fc:{<slot tag>}<pod>    string: a copy of the pod's fencing token
                                     ("<n>:<holder>", or "<n>:" barring every token below
                                     n), checked by the block calls of the master serving
                                     the slot
"""

from __future__ import annotations

import re
import struct
from binascii import crc_hqx
from collections.abc import Sequence
from functools import cache
from typing import Any, NamedTuple

from redis.crc import REDIS_CLUSTER_HASH_SLOTS

from globalkv.index.base import IndexUnavailable, Source
from globalkv.index.packing import DEPTH_BITS, DEPTH_MASK
from globalkv.keys import BlockKey

_PREFIX_RE = re.compile(r"[A-Za-z0-9_.:-]+")

LAYOUT = b"3"
"""Bump with any change to the index's names or value formats above."""
SEGMENT = 16
"""Blocks per head segment: a 1k-token system prompt at block size 16 spans 4 of them."""
HEAD_SEGMENTS = 16
"""Head segments; after them a segment is `TAIL_SEGMENT` blocks, since every segment costs
a lookup a walk of its own and far into a chain few prompts share one."""
TAIL_SEGMENT = 128
_HEAD = SEGMENT * HEAD_SEGMENTS
SLOTS = REDIS_CLUSTER_HASH_SLOTS
STRIDE = 10125
"""Slots between consecutive segments: 16384 / golden ratio, odd so it visits every slot."""
_ROOT_SHIFT = 50
"""A root's top 14 bits pick its first segment's slot."""


class LayoutMismatch(IndexUnavailable):
    """The prefix holds an index of another layout: reading it would give wrong answers.

    Unavailable rather than a crash, so a gateway routes by load and says why."""


class Segment(NamedTuple):
    """Blocks `start` to `start + length` of a looked-up chain, all in one slot."""

    slot: int
    head: str
    """Every name of the segment starts with it (up to the hash tag, included)."""
    digits: str
    """The segment's keys as 16 hex digits each: key i is head + digits[16i:16i+16]."""
    start: int
    length: int


@cache
def slot_tags() -> tuple[str, ...]:
    """For each cluster slot a short hash tag that hashes to it (found once, by trying)."""
    tags: list[str | None] = [None] * SLOTS
    missing, n = SLOTS, 0
    while missing:
        tag = format(n, "x")
        slot = crc_hqx(tag.encode(), 0) % SLOTS  # redis.crc.key_slot of "{tag}"
        if tags[slot] is None:
            tags[slot] = tag
            missing -= 1
        n += 1
    return tuple(t for t in tags if t is not None)


def segment_slot(root: int, segment: int) -> int:
    return ((root >> _ROOT_SHIFT) + segment * STRIDE) % SLOTS


def segment_of(depth: int) -> int:
    """The segment holding the block at position `depth` of its chain."""
    if depth < _HEAD:
        return depth // SEGMENT
    return HEAD_SEGMENTS + (depth - _HEAD) // TAIL_SEGMENT


class RedisKeys:
    __slots__ = (
        "block_prefix",
        "dead",
        "gateway_pending",
        "gateways",
        "indexers",
        "layout",
        "live",
        "marker",
        "next_gen",
        "prefix",
        "registry_changed",
        "registry_marker",
        "registry_pods",
        "registry_state",
        "sources",
        "tag",
    )

    def __init__(self, prefix: str = "gkv") -> None:
        if not _PREFIX_RE.fullmatch(prefix):
            raise ValueError(
                f"redis key prefix {prefix!r} must be letters, digits and _.:- only "
                "(braces would break the hash tags)"
            )
        self.prefix = prefix
        self.tag = f"{{{prefix}}}"
        """The hash tag of every key but the blocks (the registry's too)."""
        self.block_prefix = f"{prefix}:b:"
        index = f"{self.tag}:index"
        self.sources = f"{index}:sources"
        self.live = f"{index}:live"
        self.dead = f"{index}:dead"
        self.next_gen = f"{index}:gen:next"
        self.marker = f"{index}:marker"
        self.layout = f"{index}:layout"
        registry = f"{self.tag}:registry"
        self.registry_pods = f"{registry}:pods"
        self.registry_state = f"{registry}:state"
        self.registry_marker = f"{registry}:marker"
        self.registry_changed = f"{registry}:changed"
        self.indexers = f"{self.tag}:indexers"
        self.gateways = f"{prefix}:gateways"
        self.gateway_pending = f"{prefix}:gw:pending"

    def block(self, at: int, key: BlockKey) -> str:
        """The name of `key` at place `at` (`packing.place`: its chain root and position)."""
        return self.block_in(self.block_slot(at), key)

    def block_in(self, slot: int, key: BlockKey) -> str:
        """The name of `key` in the segment placed on `slot`."""
        return f"{self.block_prefix}{{{slot_tags()[slot]}}}{key:016x}"

    def block_slot(self, at: int) -> int:
        return segment_slot(at >> DEPTH_BITS, segment_of(at & DEPTH_MASK))

    def segments(self, keys: Sequence[BlockKey]) -> list[Segment]:
        """A looked-up chain (`keys[0]` its root) cut into its segments, in order.

        Names are built once per segment as one string, because a lookup sends hundreds
        of them and per-name formatting is most of its Python cost.
        """
        root, tags, prefix = keys[0], slot_tags(), self.block_prefix
        digits = struct.pack(f">{len(keys)}Q", *keys).hex()
        out = []
        start, i = 0, 0
        while start < len(keys):
            slot = segment_slot(root, i)
            length = min(SEGMENT if i < HEAD_SEGMENTS else TAIL_SEGMENT, len(keys) - start)
            part = digits[16 * start : 16 * (start + length)]
            out.append(Segment(slot, f"{prefix}{{{tags[slot]}}}", part, start, length))
            start, i = start + length, i + 1
        return out

    def checkpoint(self, slot: int, writer: str) -> str:
        """A writer's counter of block calls on `slot` (redis_checkpoints.py)."""
        return f"{self.prefix}:ck:{{{slot_tags()[slot]}}}{writer}"

    def fence_copy(self, slot: int, pod: str) -> str:
        """A master's copy of `pod`'s fencing token, on `slot` (redis_fences.py)."""
        return f"{self.prefix}:fc:{{{slot_tags()[slot]}}}{pod}"

    def log(self, gen: int) -> str:
        return f"{self.tag}:index:gen:{gen}:log"

    def info(self, gen: int) -> str:
        return f"{self.tag}:index:gen:{gen}:info"

    def lease_owner(self, pod: str) -> str:
        return f"{self.tag}:lease:{pod}:owner"

    def lease_fence(self, pod: str) -> str:
        return f"{self.tag}:lease:{pod}:fence"

    def gateway_load(self, member: str) -> str:
        return f"{self.prefix}:gw:{{{member}}}:load"

    def gateway_flow(self, member: str) -> str:
        return f"{self.prefix}:gw:{{{member}}}:flow"


async def check_layout(redis: Any, keys: RedisKeys) -> None:
    """Claim an empty prefix for `LAYOUT`, or raise `LayoutMismatch` if it holds another.

    A reader or writer of another layout does not fail by itself: it misreads (wrong
    depths, wrong pods) or corrupts. `redis` is a client of one Redis or of a cluster
    (`redis_client`). Redis errors pass through: callers turn them into
    `IndexUnavailable`.
    """
    found = await redis.get(keys.layout)
    if found is None:
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
