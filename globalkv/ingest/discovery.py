"""Pods that appear by themselves on the bound socket, and their way into the registry.

A bound SUB takes any topic anyone sends. A `kv@<pod>@<model>` topic that names a pod
nobody registered becomes a followed pod here, and is written to the registry so every
gateway sees it; a failed write is retried by `register_discovered`, which podsync runs
before it reads the registry (an unwritten pod would read as deleted there).

With several indexers, a pod another indexer may follow (`may_follow` says no) is not
followed here: it is only written to the registry once, so that it can be assigned, and
its messages count as `not_owner` rather than `unknown_topic`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from pydantic import ValidationError

from globalkv.index.base import IndexUnavailable
from globalkv.ingest.followed import FollowedPod, FollowedPods
from globalkv.registry import KvEventsConfig, PodInfo, Registry
from kvplumbing.topics import parse_topic

log = logging.getLogger(__name__)

MAX_UNOWNED = 4096
"""Other indexers' pods remembered as seen on the bound socket (a bound SUB takes any
topic anyone sends: the set must not grow without end)."""

Spawn = Callable[[Coroutine[Any, Any, None], str], "asyncio.Task[None]"]


class Discovery:
    def __init__(
        self,
        pods: FollowedPods,
        registry: Callable[[], Registry],
        may_follow: Callable[[str], bool],
        spawn: Spawn,
    ) -> None:
        self._pods = pods
        self._registry = registry
        """The service's registry, read at each write (it may be replaced)."""
        self._may_follow = may_follow
        self._spawn = spawn
        self._unregistered: set[str] = set()
        """Pods that appeared on the bound socket and are not in the registry yet."""
        self._unowned_seen: set[str] = set()
        """Pods of others seen on the bound socket, written to the registry once."""

    def pod_for(self, topic: str) -> FollowedPod | None:
        """The followed pod `topic` belongs to, added if it names a new pod this indexer
        may follow; None for a topic of no pod, of a clashing id, or of another's pod."""
        pod = self._pods.by_topic(topic)
        if pod is not None:
            return pod
        parsed = parse_topic(topic)
        if parsed is None:
            return None
        try:
            info = PodInfo(
                id=parsed[0], model=parsed[1], kv_events=KvEventsConfig(mode="bind", topic=topic)
            )
        except ValidationError:
            return None
        if info.id in self._pods:
            return None  # the id is taken by a pod configured differently
        if not self._may_follow(info.id):
            if info.id not in self._unowned_seen and len(self._unowned_seen) < MAX_UNOWNED:
                self._unowned_seen.add(info.id)
                self._spawn(self._register_unowned(info), f"registering pod {info.id}")
            return None
        log.info("pod %s appeared on the bound socket (topic %r)", info.id, topic)
        pod = self._pods.add(info)
        self._unregistered.add(info.id)
        self._spawn(self._register_now(), f"registering pod {info.id}")
        return pod

    def is_unowned(self, topic: str) -> bool:
        """Whether `topic` is of a pod another indexer follows (seen here before)."""
        parsed = parse_topic(topic)
        return parsed is not None and parsed[0] in self._unowned_seen

    async def register_discovered(self) -> None:
        """Write the pods found on the bound socket to the registry (IndexUnavailable
        when it cannot be written: they are tried again on the next call)."""
        for pod_id in sorted(self._unregistered):
            pod = self._pods.get(pod_id)
            if pod is not None:
                await self._registry().put(pod.info)
            self._unregistered.discard(pod_id)

    async def _register_unowned(self, info: PodInfo) -> None:
        """Another indexer may be assigned it, but only once the registry lists it."""
        try:
            if await self._registry().get(info.id) is None:
                await self._registry().put(info)
        except IndexUnavailable as exc:
            self._unowned_seen.discard(info.id)
            log.warning("could not write discovered pod %s to the registry: %s", info.id, exc)

    async def _register_now(self) -> None:
        try:
            await self.register_discovered()
        except IndexUnavailable as exc:
            log.warning("could not write discovered pods to the registry yet: %s", exc)
