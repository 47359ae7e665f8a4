"""What this gateway placed on each prefill, and what placing more there would evict.

The index shows what a pod's cache holds now, not how much was given to it: a full cache
looks the same whether its contents are wanted again or not, and while prompts are being
placed the caches fill before their demand shows. So the prefix policy keeps, per prefill
worker, the distinct index blocks it sent there (`placed`: shared prefixes once, least
recently sent first, at most `retain` × the worker's capacity, the count `cache_aware`'s
tree keeps) and two running sums over the blocks it asked each worker to compute:

- `computed`: prompt blocks the worker had to compute (neither cached nor pending there);
- `recomputed`: the part of those this gateway had placed on that worker before, i.e.
  blocks its cache evicted and a later prompt wanted again.

Both decay by half per capacity's worth of computed blocks, so they describe the caches'
last turnover. Summed over the workers, `recomputed / computed` is the share of evictions
that came back as misses: the probability that a block one more placement evicts is
needed again. It is one number for the cluster: per worker, a cache that mostly received
cold prompts looks cheap to evict from and draws every cold prompt, which piles load on
it. Before any data the share is 1 (both sums start at one capacity), which the first
turnovers wash out.

`eviction(worker, capacity, new, copied)`, the blocks other prompts are expected to lose
if `new` blocks no pod holds and `copied` blocks another pod holds are computed on a
worker, is `(new + 2 × copied) × fill × share` with `fill = min((placed + new + copied) /
capacity, 1)`: a cache given less than it holds keeps most of what it has, one given more
than it holds evicts a block for each new one. Linear in the fill rather than a step at
the capacity because, as the prompts of a group arrive over time, what was placed so far
understates what a pod will have to hold. A copied
block weighs twice: it evicts a block where it lands as a new one does, and the room it
takes holds a block the cluster already has, which serves no prompt the holder would not.
Charging copies like new blocks let small groups spread over several pods while the pods
were busy (each choice's replayed figures: `docs/gateway-design.md`).

Whether to charge a copy at all depends on the prefix's demand, which the ledger counts
over the last `demand_window` (256) prompts it recorded: `demand(key)` is the share of
them that hold `key`. A prefix wanted by a larger share of prompts than its holders are
of the candidates is more than those holders can serve: a copy relieves them rather than
wasting room, and the policy does not charge it (`gateway.policies.prefix`). Without
that, the cost kept a group hotter than one pod on that pod. The window is a count of prompts, not a
time, so the policy reads no clock; 256 resolves a share of 1/16, one pod of 16.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

DEFAULT_RETAIN = 2.0
DEFAULT_DEMAND_WINDOW = 256
COPY_FACTOR = 2.0
"""A copied block counts twice: it evicts a block here as a new one does, and it takes the
room with a block the cluster already holds."""


@dataclass(slots=True)
class _Worker:
    capacity: int
    placed: OrderedDict[int, None] = field(default_factory=OrderedDict)
    computed: float = 0.0
    recomputed: float = 0.0

    def __post_init__(self) -> None:
        self.computed = self.recomputed = float(self.capacity)


class PlacementLedger:
    """Per prefill worker: the blocks placed there and how often evicted ones came back."""

    def __init__(
        self, retain: float = DEFAULT_RETAIN, demand_window: int = DEFAULT_DEMAND_WINDOW
    ) -> None:
        if retain < 1:
            raise ValueError("retain must be at least 1 (one capacity)")
        if demand_window < 1:
            raise ValueError("demand_window must be at least 1 prompt")
        self.retain = retain
        self.demand_window = demand_window
        self._workers: dict[str, _Worker] = {}
        self._recent: deque[frozenset[int]] = deque(maxlen=demand_window)

    def placed(self, worker: str) -> int:
        """Distinct blocks on record for the worker."""
        state = self._workers.get(worker)
        return 0 if state is None else len(state.placed)

    def recompute_share(self) -> float:
        """The share of the workers' recent computed blocks they had been given before (1.0
        before any was seen)."""
        computed = sum(state.computed for state in self._workers.values())
        recomputed = sum(state.recomputed for state in self._workers.values())
        return 1.0 if computed == 0 else recomputed / computed

    def demand(self, key: int) -> float:
        """The share of the last `demand_window` prompts recorded whose keys include `key`
        (0.0 before any)."""
        recent = self._recent
        return sum(key in keys for keys in recent) / len(recent) if recent else 0.0

    def eviction(self, worker: str, capacity: int, new: int, copied: int = 0) -> float:
        """Blocks that other prompts are expected to lose if `new` blocks no pod holds and
        `copied` blocks another pod holds are computed on the worker, whose cache holds
        `capacity` blocks (a copied block weighs `COPY_FACTOR`)."""
        blocks = new + copied
        if blocks <= 0 or capacity <= 0:
            return 0.0
        fill = min((self.placed(worker) + blocks) / capacity, 1.0)
        return (new + COPY_FACTOR * copied) * fill * self.recompute_share()

    def record(self, worker: str, capacity: int, keys: Sequence[int], hit_blocks: int) -> None:
        """The prompt of `keys` went to the worker, its first `hit_blocks` cached or pending
        there: the rest are computed, and those already on record were recomputed."""
        self._recent.append(frozenset(keys))
        state = self._workers.get(worker)
        if state is None or state.capacity != capacity:
            state = self._workers[worker] = _Worker(
                capacity, state.placed if state is not None else OrderedDict()
            )
        placed = state.placed
        computed = max(len(keys) - hit_blocks, 0)
        if computed:
            recomputed = sum(1 for key in keys[hit_blocks:] if key in placed)
            keep = 0.5 ** (computed / capacity)
            state.computed = state.computed * keep + computed
            state.recomputed = state.recomputed * keep + recomputed
        for key in keys:
            placed[key] = None
            placed.move_to_end(key)
        limit = int(self.retain * capacity)
        while len(placed) > limit:
            placed.popitem(last=False)

    def forget(self, worker: str) -> None:
        self._workers.pop(worker, None)
