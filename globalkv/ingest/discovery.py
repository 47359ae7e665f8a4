"""Pods that appear by themselves on the bound socket, and their way into the registry.

A bound SUB takes any topic anyone sends. A `kv@<pod>@<model>` topic that names a pod
nobody registered becomes a followed pod here, and is written to the registry so every
gateway sees it; a failed write is retried by `register_discovered`, which podsync runs
before it reads the registry (an unwritten pod would read as deleted there).

With several indexers, a pod another indexer may follow (`may_follow` says no) is not
followed here: it is only written to the registry once, so that it can be assigned, and
its messages count as `not_owner` rather than `unknown_topic`.

Anyone who reaches the bound socket can name pods, so a pod is discovered only from a
batch that decoded (the caller's part), and at most `max_discovered` discovered pods are
followed at once: past that, a new topic's messages are dropped as `pod_limit` (logged
once each time the limit is reached) until one of them is removed. Their DP ranks are
bounded together too (`max_sources`, each a worker: `source_limit`), and a discovered pod
silent for `idle_secs` is forgotten (`idle`, which `bound` removes), so names that come
and go cost nothing once gone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal

from pydantic import ValidationError

from globalkv.index.base import IndexUnavailable
from globalkv.ingest.followed import FollowedPod, FollowedPods
from globalkv.ingest.tasks import Background
from globalkv.registry import KvEventsConfig, PodInfo, Registry
from kvplumbing.topics import parse_topic

log = logging.getLogger(__name__)

MAX_UNOWNED = 4096
"""Other indexers' pods remembered as seen on the bound socket (a bound SUB takes any
topic anyone sends: the set must not grow without end)."""

Refusal = Literal["unknown_topic", "not_owner", "pod_limit"]
"""Why a message names no followed pod: its drop reason."""


class Discovery:
    def __init__(
        self,
        pods: FollowedPods,
        registry: Registry,
        may_follow: Callable[[str], bool],
        background: Background,
        max_discovered: int,
        max_sources: int,
        idle_secs: float,
    ) -> None:
        self._pods = pods
        self._registry = registry
        self._may_follow = may_follow
        self._background = background
        self._unregistered: set[str] = set()
        """Pods that appeared on the bound socket and are not in the registry yet."""
        self._unowned_seen: set[str] = set()
        """Pods of others seen on the bound socket, written to the registry once."""
        self.max_discovered = max_discovered
        self._discovered: set[str] = set()
        """Pods followed because they appeared here, until removed (`forget`)."""
        self._limit_logged = False
        self.max_sources = max_sources
        self.idle_secs = idle_secs

    def may_add_source(self, pod: FollowedPod) -> bool:
        """Whether a new DP rank of `pod` may get a worker: a registered pod's always, a
        discovered pod's while all discovered pods have fewer than `max_sources`."""
        if pod.info.id not in self._discovered:
            return True
        held = 0
        for pod_id in self._discovered:
            found = self._pods.get(pod_id)
            held += 0 if found is None else len(found.workers)
        return held < self.max_sources

    def idle(self, now: float) -> list[str]:
        """Discovered pods with no message for `idle_secs` at `now` (time.monotonic())."""
        stale = []
        for pod_id in sorted(self._discovered):
            pod = self._pods.get(pod_id)
            if pod is not None and now - pod.last_message >= self.idle_secs:
                stale.append(pod_id)
        return stale

    def pod_for(self, topic: str) -> FollowedPod | Refusal:
        """The followed pod `topic` belongs to, added if it names a new pod this indexer
        may follow and the limit allows; otherwise why not: a topic of no pod or of a
        clashing id, another's pod, or one pod too many."""
        pod = self._pods.by_topic(topic)
        if pod is not None:
            return pod
        parsed = parse_topic(topic)
        if parsed is None:
            return "unknown_topic"
        try:
            info = PodInfo(
                id=parsed[0], model=parsed[1], kv_events=KvEventsConfig(mode="bind", topic=topic)
            )
        except ValidationError:
            return "unknown_topic"
        if info.id in self._pods:
            return "unknown_topic"  # the id is taken by a pod configured differently
        if not self._may_follow(info.id):
            if info.id not in self._unowned_seen and len(self._unowned_seen) < MAX_UNOWNED:
                self._unowned_seen.add(info.id)
                self._background.spawn(self._register_unowned(info), f"registering pod {info.id}")
            return "not_owner" if info.id in self._unowned_seen else "unknown_topic"
        if len(self._discovered) >= self.max_discovered:
            if not self._limit_logged:
                self._limit_logged = True
                log.warning(
                    "pod %s appeared on the bound socket, but %d discovered pods are followed "
                    "already (the limit): its messages are dropped as pod_limit",
                    info.id,
                    len(self._discovered),
                )
            return "pod_limit"
        log.info("pod %s appeared on the bound socket (topic %r)", info.id, topic)
        pod = self._pods.add(info)
        self._discovered.add(info.id)
        self._unregistered.add(info.id)
        self._background.spawn(self._register_now(), f"registering pod {info.id}")
        return pod

    def forget(self, pod_id: str) -> None:
        """The pod stopped being followed: it no longer counts against the limit."""
        if pod_id in self._discovered:
            self._discovered.discard(pod_id)
            self._limit_logged = False

    async def unregister(self, pod_id: str) -> None:
        """Take a discovered pod out of the registry (IndexUnavailable when it cannot)."""
        self._unregistered.discard(pod_id)
        await self._registry.remove(pod_id)

    async def register_discovered(self) -> None:
        """Write the pods found on the bound socket to the registry (IndexUnavailable
        when it cannot be written: they are tried again on the next call)."""
        for pod_id in sorted(self._unregistered):
            pod = self._pods.get(pod_id)
            if pod is not None:
                await self._registry.put(pod.info)
            self._unregistered.discard(pod_id)

    async def _register_unowned(self, info: PodInfo) -> None:
        """Another indexer may be assigned it, but only once the registry lists it."""
        try:
            if await self._registry.get(info.id) is None:
                await self._registry.put(info)
        except IndexUnavailable as exc:
            self._unowned_seen.discard(info.id)
            log.warning("could not write discovered pod %s to the registry: %s", info.id, exc)

    async def _register_now(self) -> None:
        try:
            await self.register_discovered()
        except IndexUnavailable as exc:
            log.warning("could not write discovered pods to the registry yet: %s", exc)
