"""Which pods this indexer follows when several share one Redis: leases, kept and moved.

Every `interval` (a third of the lease TTL) the indexer announces itself, renews the
leases it holds, computes the assignment of the registry's pods over the live indexers
(`leases.assign`, the same on every indexer) and moves towards it: a pod it holds but is
no longer assigned is stopped and released (another indexer takes it at its next step),
an assigned pod that is free is acquired (on a Redis Cluster its fence copied to every
master before the grant returns: `Leases.acquire`) and followed; one still held by
another is tried again the moment that lease runs out, so a dead indexer's pods go
unfollowed at most about the TTL after it last renewed. Following starts where the index
says the previous holder stopped (`Following` resumes from the last applied seq, by
replay from the engine's buffer, else resets the source).

`HeldLeases` is what ingest and this loop share: the leases held and until when they are
surely valid. Ingest asks it whether a pod may be followed and tells it when a write was
fenced; it is built first and handed to both, so neither reaches into the other.

A lease this indexer cannot renew — another took it, or Redis did not answer within the
TTL — is given up locally: the pod is no longer followed, so at steady state no pod is
followed twice. What its workers already hold is offered to the index first, briefly
(an indexer resuming from a pause holds batches received before it): the index's fence
check refuses those late writes and they are counted (`globalkv_ingest_fenced_writes_total`).

Two live processes under one indexer id (a copied configuration): a process restarted
under its id takes its predecessor's leases at once (`Leases.acquire`), which is right
for a restart but, with both alive, each would take the pods back from the other at every
step, and every takeover fences the other's writes. So a process that lost a lease to
another of its own id is displaced: it says so (an error, `globalkv_ingest_displaced` 1)
and takes no lease that process holds, only pods whose lease runs out.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable

from globalkv.index.base import Fence, IndexUnavailable
from globalkv.ingest.following import Following
from globalkv.ingest.leases import Held, Leases, assign
from globalkv.metrics import IngestMetrics
from globalkv.registry import PodInfo, Registry
from kvplumbing.clock import Clock

log = logging.getLogger(__name__)


class HeldLeases:
    """The pod leases this indexer holds: ingest's `PodGate` when indexers share pods."""

    def __init__(
        self,
        metrics: IngestMetrics,
        *,
        set_fence: Callable[[str, Fence | None], None],
        clock: Clock = time.monotonic,
    ) -> None:
        """`set_fence(pod, fence)` tells the index which lease its writes of a pod carry."""
        self._metrics = metrics
        self._set_fence = set_fence
        self.clock = clock
        self.fences: dict[str, Fence] = {}
        self.valid_until = 0.0
        """Monotonic time until which the leases renewed last are surely still ours."""
        self.fenced_out: set[str] = set()
        """Pods given up because a write was fenced, not yet checked for who took them."""

    def holds(self, pod: str) -> bool:
        return pod in self.fences and self.clock() < self.valid_until

    def lost(self, pod: str) -> None:
        """A write was fenced, so the lease is another's already."""
        if pod in self.fences:
            log.warning("pod %s: a write was fenced; its lease is another indexer's", pod)
            self.drop(pod)
            self.fenced_out.add(pod)

    def hold(self, pod: str, fence: Fence) -> None:
        self.fences[pod] = fence
        self._set_fence(pod, fence)
        self._metrics.leases_held.set(len(self.fences))

    def drop(self, pod: str) -> None:
        self.fences.pop(pod, None)
        self._set_fence(pod, None)
        self._metrics.leases_held.set(len(self.fences))


class Ownership:
    def __init__(
        self,
        leases: Leases,
        registry: Registry,
        following: Following,
        held: HeldLeases,
        metrics: IngestMetrics,
        *,
        member: str,
        ttl: float,
        copy_fence: Callable[[str, str], Awaitable[None]] | None = None,
    ) -> None:
        """`copy_fence(pod, token)` writes a token to the index's copies of the pod's fence
        (`Leases.acquire`'s `copy`: a Redis Cluster's masters each check one)."""
        self.leases = leases
        self.registry = registry
        self.following = following
        self.held = held
        self.metrics = metrics
        self.member = member
        self.ttl = ttl
        self.interval = ttl / 3
        self._copy_fence = copy_fence
        self.clock = held.clock
        self.members: list[str] = []
        self._retry_at: float | None = None
        """When a lease we are waiting for runs out (monotonic), if sooner than a step."""
        self.displaced = False
        """A later process under our id took a lease of ours: we take none from it."""
        self._lock = asyncio.Lock()

    async def run(self) -> None:
        while True:
            try:
                await self.step()
            except IndexUnavailable as exc:
                log.warning("leases: redis unavailable: %s", exc)
                if self.held.fences and self.clock() >= self.held.valid_until:
                    log.warning("leases not renewed within %.1fs: following no pod", self.ttl)
                    async with self._lock:
                        await self._drop_lost(sorted(self.held.fences))
            await asyncio.sleep(self._pause())

    def _pause(self) -> float:
        """Until the next step: an interval, or less when a lease we want runs out sooner."""
        if self._retry_at is None:
            return self.interval
        return min(self.interval, max(0.01, self._retry_at - self.clock()))

    async def step(self) -> None:
        """One round: heartbeat, renew, rebalance. `IndexUnavailable` when Redis fails."""
        async with self._lock:
            started = self.clock()
            live = await self.leases.heartbeat(self.member, self.ttl)
            self.members = sorted(live)
            self.metrics.live_indexers.set(len(live))
            pods = {p.id: p for p in await self.registry.list()}
            kept = await self.leases.renew(self.held.fences, self.ttl)
            self.held.valid_until = started + self.ttl
            lost = sorted(set(self.held.fences) - kept)
            for pod in lost:
                log.warning("lease of pod %s lost; no longer following it", pod)
            await self._drop_lost(lost)
            await self._check_displaced([*lost, *sorted(self.held.fenced_out)])
            wanted = {p for p, m in assign(pods, self.members).items() if m == self.member}
            for pod in sorted(set(self.held.fences) - wanted):
                await self._give_up(pod, gone=pod not in pods)
            # A member whose heartbeat runs out before our next step has stopped renewing:
            # step again the moment it drops out, to take its pods without delay.
            fading = [left for m, left in live.items() if m != self.member and left < self.interval]
            self._retry_at = None if not fading else self.clock() + min(fading) + 0.01
            for pod in await self._takeable(sorted(wanted - set(self.held.fences))):
                await self._take(pods[pod])

    async def stop(self) -> None:
        """Release every lease and leave, so the others take the pods over at once."""
        async with self._lock:
            for pod in sorted(self.held.fences):
                await self._give_up(pod, gone=False)
            await self.leases.leave(self.member)

    async def _check_displaced(self, pods: list[str]) -> None:
        """Whether a process of our own id took any of these lost pods (module docstring)."""
        self.held.fenced_out.clear()
        if self.displaced or not pods:
            return
        takers = await self.leases.owners(pods)
        taken = sorted(pod for pod, member in takers.items() if member == self.member)
        if taken:
            self.displaced = True
            self.metrics.displaced.set(1)
            log.error(
                "indexer id %r is also used by another live process, which took pod(s) %s: "
                "this one takes no lease from it from now on; give each indexer its own id",
                self.member,
                ", ".join(taken),
            )

    async def _takeable(self, pods: list[str]) -> list[str]:
        """The pods to try to take: all, or once displaced, those no process of our id holds."""
        if not self.displaced or not pods:
            return pods
        holders = await self.leases.owners(pods)
        return [pod for pod in pods if holders.get(pod) != self.member]

    async def _take(self, info: PodInfo) -> None:
        copy = None if self._copy_fence is None else functools.partial(self._copy_fence, info.id)
        # Grant, then copies on every master, then following: see `Leases.acquire`.
        grant = await self.leases.acquire(info.id, self.member, self.ttl, copy=copy)
        if isinstance(grant, Held):  # the previous owner releases it, or it runs out
            retry = self.clock() + grant.expires_in + 0.01
            self._retry_at = retry if self._retry_at is None else min(self._retry_at, retry)
            return
        if grant.unfollowed is not None:
            self.metrics.takeovers.inc()
            self.metrics.unfollowed.observe(grant.unfollowed)
            log.info("pod %s taken over, unfollowed for at most %.2fs", info.id, grant.unfollowed)
        self.held.hold(info.id, grant.fence)
        try:
            await self.following.add(info)
        except ValueError as exc:  # TopicTaken, EndpointRefused: reported, lease kept
            log.warning("not following pod %s: %s", info.id, exc)

    async def _give_up(self, pod: str, *, gone: bool) -> None:
        """Stop following (clearing its blocks when it left the registry), then release."""
        fence = self.held.fences.get(pod)
        await self._drop(pod, clear=gone)
        if fence is not None:
            await self.leases.release(pod, fence)

    async def _drop_lost(self, pods: list[str]) -> None:
        await asyncio.gather(*(self._drop(p, clear=False, drain=self.interval) for p in pods))

    async def _drop(self, pod: str, *, clear: bool, drain: float = 0.0) -> None:
        """Stop the workers before the fence goes: a write is refused only by the index."""
        try:
            await self.following.remove(pod, clear=clear, drain=drain)
        except IndexUnavailable as exc:  # cleared later (`Following.clear_removed`)
            log.warning("pod %s: blocks not cleared yet: %s", pod, exc)
        self.held.drop(pod)
