"""sglang-router's cache_aware policy, over tokens when we have them.

Per request, as sgl-model-gateway does it (defaults from sglang-router 0.3.2):
1. Imbalanced load — `max - min > balance_abs_threshold` (64) and
   `max > min * balance_rel_threshold` (1.5), load = requests in flight — the least
   loaded candidate wins.
2. Otherwise the prompt is matched against the tree of prompts routed so far; if the
   matched fraction exceeds `cache_threshold` (0.3) its most recent holder wins, else the
   candidate holding the least in the tree (the emptiest cache).
3. The prompt is inserted under the winner. Every `eviction_interval_secs` (60, read
   from `request.now`) each worker is trimmed to `max_tree_size` tokens, LRU first.

The key is the prompt's token ids, or its text's code points when it could not be
tokenized (sglang-router keys characters); with neither it falls back to least load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from gateway.load.tracker import Candidate
from gateway.policies.base import Choice, Policy
from gateway.policies.radix import RadixTree
from gateway.requests.query import RouteQuery
from gateway.settings.routing import CacheAwareConfig


class CacheAwarePolicy:
    name = "cache_aware"
    uses_index = False
    reads_load = True

    def __init__(self, config: CacheAwareConfig, fallback: Policy) -> None:
        self._config = config
        self._fallback = fallback
        self.tree = RadixTree()
        self._last_eviction: float | None = None

    def choose(self, request: RouteQuery, candidates: Sequence[Candidate]) -> Choice:
        if request.tokens is not None:
            key: Sequence[int] = request.tokens
        elif request.text is not None:
            key = [ord(c) for c in request.text]
        else:
            return replace(self._fallback.choose(request, candidates), fallback="no_tokens")
        self._maybe_evict(request.now)
        cfg = self._config
        loads = [c.in_flight for c in candidates]
        high, low = max(loads), min(loads)
        hit = 0
        if high - low > cfg.balance_abs_threshold and high > low * cfg.balance_rel_threshold:
            chosen = candidates[loads.index(low)].worker
        else:
            matched, holder = self.tree.match(key, {c.worker for c in candidates})
            if holder is not None and key and matched / len(key) > cfg.cache_threshold:
                chosen, hit = holder, matched
            else:
                chosen = min(candidates, key=lambda c: self.tree.sizes.get(c.worker, 0)).worker
        self.tree.insert(key, chosen, request.now)
        hit_tokens = hit if request.tokens is not None else 0
        return Choice(
            chosen,
            hit_tokens=hit_tokens,
            uncached_tokens=max(request.prompt_tokens - hit_tokens, 0),
        )

    def _maybe_evict(self, now: float) -> None:
        if self._last_eviction is None:
            self._last_eviction = now
        elif now - self._last_eviction >= self._config.eviction_interval_secs:
            self._last_eviction = now
            self.tree.evict(self._config.max_tree_size)

    def forget(self, worker: str) -> None:
        self.tree.remove_tenant(worker)
