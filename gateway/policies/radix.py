"""The approximate cache model of `cache_aware`: a radix tree of what was routed where.

Like sglang-router's tree, it records every prompt under the worker ("tenant") it was sent
to, with the time of last use per (node, tenant), and trims each tenant to a size bound
by dropping its least recently used leaves. It only approximates the engines' caches
(evictions inside the engine are invisible), which is what the global index replaces.
Sequences are token ids, or code points of the text when there are no tokens.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class _Node:
    key: tuple[int, ...]
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    tenants: dict[str, float] = field(default_factory=dict)
    """tenant → time of its last use of this node."""


def _common(a: Sequence[int], b: Sequence[int], start: int) -> int:
    n = min(len(a), len(b) - start)
    i = 0
    while i < n and a[i] == b[start + i]:
        i += 1
    return i


class RadixTree:
    def __init__(self) -> None:
        self._root = _Node((), None)
        self.sizes: dict[str, int] = {}
        """tenant → tokens it holds in the tree."""

    def insert(self, seq: Sequence[int], tenant: str, now: float) -> None:
        node = self._root
        node.tenants[tenant] = now
        self.sizes.setdefault(tenant, 0)
        i = 0
        while i < len(seq):
            child = node.children.get(seq[i])
            if child is None:
                leaf = _Node(tuple(seq[i:]), node, tenants={tenant: now})
                node.children[seq[i]] = leaf
                self.sizes[tenant] += len(leaf.key)
                return
            common = _common(child.key, seq, i)
            if common < len(child.key):
                child = self._split(child, common)
            if tenant not in child.tenants:
                self.sizes[tenant] += len(child.key)
            child.tenants[tenant] = now
            node = child
            i += len(child.key)

    @staticmethod
    def _split(child: _Node, at: int) -> _Node:
        parent = child.parent
        assert parent is not None
        mid = _Node(child.key[:at], parent, tenants=dict(child.tenants))
        parent.children[child.key[0]] = mid
        child.key = child.key[at:]
        child.parent = mid
        mid.children[child.key[0]] = child
        return mid

    def match(self, seq: Sequence[int], tenants: Collection[str]) -> tuple[int, str | None]:
        """Longest prefix of `seq` held by one of `tenants`, and its most recent holder."""
        node = self._root
        matched = 0
        holder: str | None = None
        i = 0
        while i < len(seq):
            child = node.children.get(seq[i])
            if child is None:
                break
            held = [(t, when) for t, when in child.tenants.items() if t in tenants]
            if not held:
                break
            common = _common(child.key, seq, i)
            matched += common
            holder = max(held, key=lambda item: (item[1], item[0]))[0]
            if common < len(child.key):
                break
            node = child
            i += common
        return matched, holder

    def evict(self, max_size: int) -> None:
        """Drop least recently used leaves of each tenant above `max_size` tokens."""
        for tenant, size in list(self.sizes.items()):
            if size > max_size:
                self._evict_tenant(tenant, max_size)

    def _evict_tenant(self, tenant: str, max_size: int) -> None:
        heap = [(n.tenants[tenant], id(n), n) for n in self._tenant_leaves(tenant)]
        heapq.heapify(heap)
        while heap and self.sizes[tenant] > max_size:
            _, _, node = heapq.heappop(heap)
            parent = self._drop(node, tenant)
            if parent is not None and self._is_tenant_leaf(parent, tenant):
                heapq.heappush(heap, (parent.tenants[tenant], id(parent), parent))

    def remove_tenant(self, tenant: str) -> None:
        order: list[_Node] = []
        stack = [c for c in self._root.children.values() if tenant in c.tenants]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(c for c in node.children.values() if tenant in c.tenants)
        for node in reversed(order):  # children before parents, so emptied nodes unlink
            self._drop(node, tenant)
        self._root.tenants.pop(tenant, None)
        self.sizes.pop(tenant, None)

    def _drop(self, node: _Node, tenant: str) -> _Node | None:
        """Remove `tenant` from `node`; unlink the node if nobody holds it any more."""
        del node.tenants[tenant]
        self.sizes[tenant] -= len(node.key)
        parent = node.parent
        if not node.tenants and parent is not None and not node.children:
            del parent.children[node.key[0]]
        return parent if parent is not self._root else None

    def _tenant_leaves(self, tenant: str) -> list[_Node]:
        leaves: list[_Node] = []
        stack = [c for c in self._root.children.values() if tenant in c.tenants]
        while stack:
            node = stack.pop()
            below = [c for c in node.children.values() if tenant in c.tenants]
            if below:
                stack.extend(below)
            else:
                leaves.append(node)
        return leaves

    @staticmethod
    def _is_tenant_leaf(node: _Node, tenant: str) -> bool:
        return tenant in node.tenants and not any(
            tenant in c.tenants for c in node.children.values()
        )
