"""A paged prefix cache for one DP rank: what a real engine's radix cache does, minus the GPU.

The cache holds whole pages (`page_size` tokens) in a tree keyed by page tokens, so a
request reuses the longest cached prefix and only "computes" the rest. Capacity is counted
in pages. When it is full, unused pages are evicted least-recently-used first, and only
leaves: an inner page is the prefix of a longer cached sequence and cannot go while its
children stay (that is what SGLang's `RadixCache.evict` and vLLM's free-block queue do).

Pages a request is working on are locked between `match` and `release`, so eviction never
takes a prefix out from under a running request; a request still waiting in the queue only
`peek`s, as SGLang locks a prefix only once it admits the request into a prefill batch
(`PrefillAdder._commit_prefill_admission`). If the cache is full of locked pages, the
pages that do not fit are simply not cached: the request still completes (its KV was
transient), nothing deadlocks.

Every change is reported as `CacheChange` records, in order, so the caller can publish
them as KV events: one `Stored` run per contiguous chain of new pages, one `Removed` per
eviction pass, `Cleared` on reset. Engine hashes are SGLang-like: SHA-256 chained over the
parent hash and the page's tokens (u32 little-endian), first 8 bytes as an unsigned int.

A LoRA adapter or a cache salt puts a request's pages in a tree of their own
(`CacheNamespace`), as both engines hash them into their block hashes: equal tokens under
another adapter or salt share nothing, and their engine hashes differ from the base
model's (a namespaced chain starts from a seed hashed from the namespace). A namespace's
tree goes when its last page is evicted, so clients' salts cannot grow the cache's memory.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

_U64_BE = struct.Struct(">Q")


def page_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """The engine hash of one page, chained on its parent's hash (None for a root page)."""
    digest = hashlib.sha256()
    if parent is not None:
        digest.update(_U64_BE.pack(parent))
    digest.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return int.from_bytes(digest.digest()[:8], "big")


@dataclass(frozen=True, slots=True)
class CacheNamespace:
    """Where a request's pages live: its LoRA adapter (name and the engine's id for it) and
    its cache salt; all None is the base model's."""

    lora_name: str | None = None
    lora_id: int | None = None
    cache_salt: str | None = None

    def seed(self) -> int:
        """The hash a namespaced chain starts from (0: the base model's, no seed)."""
        if self == BASE:
            return 0
        named = f"{self.lora_name or ''}\x1f{self.cache_salt or ''}".encode()
        return int.from_bytes(hashlib.sha256(named).digest()[:8], "big") or 1


BASE = CacheNamespace()


@dataclass(frozen=True, slots=True)
class Stored:
    """New pages chained after `parent` (None = chain root); `token_ids` spans all of them."""

    parent: int | None
    hashes: tuple[int, ...]
    token_ids: tuple[int, ...]
    namespace: CacheNamespace = BASE


@dataclass(frozen=True, slots=True)
class Removed:
    hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


CacheChange = Stored | Removed | Cleared


@dataclass(eq=False, slots=True)
class _Page:
    tokens: tuple[int, ...]
    hash: int
    """The engine hash; on a root, which stands for the empty prefix, its namespace's seed."""
    parent: _Page | None
    children: dict[tuple[int, ...], _Page] = field(default_factory=dict)
    refs: int = 0
    last_use: int = 0
    generation: int = 0


@dataclass(slots=True)
class Match:
    """A request's cached prefix, locked until `PagedKVCache.release`."""

    cached_tokens: int
    pages: list[_Page]
    released: bool = False


@dataclass(frozen=True, slots=True)
class CacheStats:
    pages: int
    capacity: int
    locked_pages: int
    evicted_pages: int
    stored_pages: int
    uncached_pages: int
    """Computed pages not kept because every cached page was locked by a running request."""


class PagedKVCache:
    def __init__(self, page_size: int, capacity: int) -> None:
        if page_size <= 0:
            raise ValueError("page_size must be positive")
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.page_size = page_size
        self.capacity = capacity
        self._generation = 0
        self._roots: dict[CacheNamespace, _Page] = {}
        self._pages = 0
        self._tick = itertools.count(1)
        self._evictable: list[tuple[int, int, _Page]] = []
        self._heap_seq = itertools.count()
        self._evicted = 0
        self._stored = 0
        self._uncached = 0

    def __len__(self) -> int:
        return self._pages

    def stats(self) -> CacheStats:
        return CacheStats(
            pages=self._pages,
            capacity=self.capacity,
            locked_pages=sum(1 for page in self._walk() if page.refs > 0),
            evicted_pages=self._evicted,
            stored_pages=self._stored,
            uncached_pages=self._uncached,
        )

    def match(self, tokens: Sequence[int], namespace: CacheNamespace = BASE) -> Match:
        """Lock and return the longest cached whole-page prefix of `tokens`.

        Like SGLang, the last prompt token is never served from cache: the engine must run
        at least one token to produce the first output's logits.
        """
        pages = self._prefix(tokens, namespace)
        now = next(self._tick)
        for page in pages:
            page.refs += 1
            page.last_use = now
        return Match(cached_tokens=len(pages) * self.page_size, pages=pages)

    def peek(self, tokens: Sequence[int], namespace: CacheNamespace = BASE) -> int:
        """The cached tokens `match` would find now, without locking or touching them: what
        a request waiting in the queue is expected to reuse."""
        return len(self._prefix(tokens, namespace)) * self.page_size

    def _prefix(self, tokens: Sequence[int], namespace: CacheNamespace) -> list[_Page]:
        limit = max(len(tokens) - 1, 0) // self.page_size * self.page_size
        pages: list[_Page] = []
        node = self._roots.get(namespace)
        if node is None:
            return pages
        for start in range(0, limit, self.page_size):
            child = node.children.get(tuple(tokens[start : start + self.page_size]))
            if child is None:
                break
            pages.append(child)
            node = child
        return pages

    def release(self, match: Match) -> None:
        if match.released:
            return
        match.released = True
        for page in match.pages:
            page.refs -= 1
            self._maybe_evictable(page)

    def insert(self, tokens: Sequence[int], namespace: CacheNamespace = BASE) -> list[CacheChange]:
        """Cache every whole page of `tokens`, evicting unused leaves to make room."""
        now = next(self._tick)
        node = self._root(namespace)
        root = node
        whole = len(tokens) // self.page_size * self.page_size
        start = 0
        path: list[_Page] = []
        while start < whole:
            child = node.children.get(tuple(tokens[start : start + self.page_size]))
            if child is None:
                break
            child.last_use = now
            path.append(child)
            node = child
            start += self.page_size
        new_pages = (whole - start) // self.page_size
        if new_pages == 0:
            self._maybe_evictable(node)
            self._drop_if_empty(root)
            return []
        for page in path:
            page.refs += 1
        evicted = self._evict(self._pages + new_pages - self.capacity)
        for page in path:
            page.refs -= 1
        room = min(new_pages, self.capacity - self._pages)
        self._uncached += new_pages - room
        changes: list[CacheChange] = []
        if evicted:
            changes.append(Removed(tuple(evicted)))
        if room <= 0:
            self._maybe_evictable(node)
            self._drop_if_empty(root)
            return changes
        parent_hash = self._hash_of(node)
        hashes: list[int] = []
        end = start + room * self.page_size
        for page_start in range(start, end, self.page_size):
            page_tokens = tuple(tokens[page_start : page_start + self.page_size])
            page = _Page(
                tokens=page_tokens,
                hash=page_hash(node.hash or None, page_tokens),
                parent=node,
                last_use=now,
                generation=self._generation,
            )
            node.children[page_tokens] = page
            hashes.append(page.hash)
            node = page
        self._pages += room
        self._stored += room
        self._maybe_evictable(node)
        changes.append(Stored(parent_hash, tuple(hashes), tuple(tokens[start:end]), namespace))
        return changes

    def _root(self, namespace: CacheNamespace) -> _Page:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = _Page(tokens=(), hash=namespace.seed(), parent=None)
        return root

    def _drop_if_empty(self, root: _Page) -> None:
        """A namespace's tree goes with its last page (the base model's root stays)."""
        if not root.children and root.hash:
            for namespace, held in list(self._roots.items()):
                if held is root:
                    del self._roots[namespace]

    def reset(self) -> list[CacheChange]:
        """Drop everything, as a flush or an engine restart does.

        Requests still holding a `Match` keep their (now detached) pages; the generation
        bump keeps those pages out of eviction when they are released.
        """
        self._generation += 1
        self._roots = {}
        self._pages = 0
        self._evictable.clear()
        return [Cleared()]

    def _evict(self, needed: int) -> list[int]:
        removed: list[int] = []
        while needed > 0 and self._evictable:
            last_use, _, page = heapq.heappop(self._evictable)
            if not self._is_evictable(page) or page.last_use != last_use:
                continue
            parent = page.parent
            assert parent is not None
            del parent.children[page.tokens]
            page.parent = None
            if parent.parent is None:
                self._drop_if_empty(parent)
            removed.append(page.hash)
            self._pages -= 1
            self._evicted += 1
            needed -= 1
            self._maybe_evictable(parent)
        return removed

    def _hash_of(self, page: _Page) -> int | None:
        return None if page.parent is None else page.hash

    def _is_evictable(self, page: _Page) -> bool:
        return (
            page.parent is not None
            and page.refs == 0
            and not page.children
            and page.generation == self._generation
        )

    def _maybe_evictable(self, page: _Page) -> None:
        if not self._is_evictable(page):
            return
        heapq.heappush(self._evictable, (page.last_use, next(self._heap_seq), page))
        if len(self._evictable) > 2 * self._pages + 64:
            self._evictable = [
                (p.last_use, next(self._heap_seq), p) for p in self._walk() if self._is_evictable(p)
            ]
            heapq.heapify(self._evictable)

    def cached_chains(self, namespace: CacheNamespace = BASE) -> list[list[int]]:
        """The tokens of every cached prefix of `namespace` that no longer one extends: what
        the engine holds, for checking an index against it (each leaf page's chain)."""
        chains = []
        root = self._roots.get(namespace)
        for page in self._walk([] if root is None else [root]):
            if page.children:
                continue
            tokens: list[int] = []
            node: _Page | None = page
            while node is not None and node.parent is not None:
                tokens[:0] = node.tokens
                node = node.parent
            chains.append(tokens)
        return sorted(chains)

    def _walk(self, roots: Sequence[_Page] | None = None) -> list[_Page]:
        pages: list[_Page] = []
        chosen = self._roots.values() if roots is None else roots
        stack = [page for root in chosen for page in root.children.values()]
        while stack:
            page = stack.pop()
            pages.append(page)
            stack.extend(page.children.values())
        return pages
