"""The index interface and the internal events it consumes.

The index is written per *source*, one (pod, dp_rank) publisher, whose batches arrive in
seq order from one writer. It never sees msgpack, ZMQ or engine wire shapes: ingest turns
those into the events below. Engine hashes appear only as the handles a source uses to
name its blocks; the index resolves them through that source's own `engine hash -> key`
map, because a parent hash means nothing outside the engine that issued it.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, runtime_checkable

from globalkv.keys import BlockKey, EngineHash


class Tier(enum.IntEnum):
    """Where a source holds a block; the value is the bit used in tier masks."""

    GPU = 1
    CPU = 2
    DISK = 4


DEFAULT_TIER_WEIGHTS: dict[Tier, float] = {Tier.GPU: 1.0, Tier.CPU: 0.8, Tier.DISK: 0.5}


@dataclass(frozen=True, slots=True, order=True)
class Source:
    """One KV-event publisher: a pod's DP rank."""

    pod: str
    dp_rank: int = 0


@dataclass(frozen=True, slots=True)
class StoreBlocks:
    """A source now holds these engine blocks, chained after `parent`.

    `token_ids` holds the tokens of all listed blocks in order, `block_size` per block.
    `namespace` is the chain root (`keys.root_key`) used when `parent` is None.
    """

    hashes: Sequence[EngineHash]
    parent: EngineHash | None
    token_ids: Sequence[int]
    block_size: int
    tier: Tier
    namespace: BlockKey


@dataclass(frozen=True, slots=True)
class RemoveBlocks:
    """A source dropped these engine blocks from one tier."""

    hashes: Sequence[EngineHash]
    tier: Tier


@dataclass(frozen=True, slots=True)
class ClearSource:
    """A source dropped everything (AllBlocksCleared)."""


IndexEvent = StoreBlocks | RemoveBlocks | ClearSource


@dataclass(frozen=True, slots=True)
class SourceBatch:
    """One publisher batch, already decoded and in seq order for its source."""

    source: Source
    seq: int
    ts: float
    events: Sequence[IndexEvent]


@dataclass(slots=True)
class ApplyResult:
    """What applying a batch did; ingest turns these counts into metrics."""

    stored: int = 0
    removed: int = 0
    cleared: int = 0
    orphans: int = 0
    """Stores skipped because their parent hash was never stored by this source."""
    partial: int = 0
    """Engine blocks not keyed because they do not hold whole index blocks."""
    over_capacity: int = 0
    """Stores skipped because the index is at its configured memory bound."""
    invalid: int = 0
    """Engine blocks of stores whose token ids cannot be keyed (outside u32)."""


class Hit(NamedTuple):
    """A source's contiguous cached prefix for a looked-up chain.

    A NamedTuple, not a frozen dataclass: a lookup builds one per holding source, and the
    dataclass's __init__ cost about twice as much (a tenth of a 64-pod lookup).
    """

    source: Source
    blocks: int
    score: float


@dataclass(slots=True)
class SourceStats:
    source: Source
    epoch: int
    blocks: dict[Tier, int] = field(default_factory=dict)
    last_seq: int | None = None
    last_event_ts: float | None = None
    resets: int = 0


class IndexUnavailable(RuntimeError):
    """The backend cannot be reached; callers answer 503 or route by load, never guess."""


@dataclass(frozen=True, slots=True)
class Fence:
    """The lease a pod's writes are made under: the key holding the pod's current fencing
    token and the token this writer was granted (`ingest.leases`), and the lease's own
    key, which a writer that finds the copies of the token above its own releases."""

    key: str
    token: str
    owner: str


class IndexFenced(RuntimeError):
    """Another writer took the pod's lease over: this writer's write was refused.

    Not an `IndexUnavailable`: retrying cannot succeed, the pod is no longer ours.
    """


class IndexDataLost(IndexUnavailable):
    """The backend came back without the data it held (a Redis restart or flush), or
    without some sources' (a cluster master failed over before replicating them).

    Raised once by the writer that notices; ingest then resyncs `sources`, or every
    source it owns when that is None.
    """

    def __init__(self, message: str, sources: Collection[Source] | None = None) -> None:
        super().__init__(message)
        self.sources = None if sources is None else frozenset(sources)


@runtime_checkable
class Index(Protocol):
    """A cluster-wide map from our block keys to the sources holding them."""

    block_size: int
    """Tokens per index block; engine blocks must hold a whole number of them."""

    async def apply(self, batch: SourceBatch) -> ApplyResult:
        """Apply one batch atomically: either all of its effects are visible or none."""
        ...

    async def lookup(self, keys: Sequence[BlockKey]) -> list[Hit]:
        """Every source holding a prefix of `keys`, best score first.

        A source's depth counts only blocks contiguous from `keys[0]`.
        """
        ...

    async def reset_source(self, source: Source) -> None:
        """Hide the source from lookups at once (epoch bump), then drop its blocks."""
        ...

    async def remove_pod(self, pod: str) -> None:
        """Forget every source of a pod, in O(its blocks)."""
        ...

    async def stats(self, pod: str | None = None) -> list[SourceStats]:
        """Per-source statistics, for one pod or all."""
        ...

    async def close(self) -> None: ...
