"""The pods an indexer follows, each with its source workers and tasks, by id and by topic.

The bound SUB knows a message's pod only by its topic, so a topic names one pod at most:
a second pod claiming a topic another followed pod holds is refused (`TopicTaken`), where
it would otherwise take that pod's events from it without a word.

A pod's reported state says only what the indexer knows (`registry.PodState`): listening
is not receiving, and a task that died is not a subscription.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterator, Set
from dataclasses import dataclass, field
from typing import Any

from globalkv.index.base import Source
from globalkv.ingest.worker import SourceWorker
from globalkv.registry import PodInfo, PodState

log = logging.getLogger(__name__)


class TopicTaken(ValueError):
    """Another followed pod is named by this pod's bound topic."""


@dataclass(slots=True)
class FollowedPod:
    info: PodInfo
    workers: dict[int, SourceWorker] = field(default_factory=dict)
    """By DP rank; in bind mode a rank's worker appears with its first batch."""
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    """Its subscriptions and workers; none ends unless it failed or the pod stops."""

    def state(self, *, listening: bool, resyncing: Set[Source], now: float) -> PodState:
        """`listening`: the bound SUB is up, which is all a bind-mode subscription is."""
        sources = []
        for rank in sorted(self.workers):
            worker = self.workers[rank]
            worker.state.queue_depth = worker.queue.qsize()
            worker.state.received = worker.received
            sources.append(worker.state.model_copy())
        if self.info.kv_events.mode == "bind":
            subscribed = listening
        else:
            subscribed = bool(self.tasks) and not any(task.done() for task in self.tasks)
        return PodState(
            subscribed=subscribed,
            receiving=any(worker.received for worker in self.workers.values()),
            resyncing=any(worker.source in resyncing for worker in self.workers.values()),
            sources=sources,
            updated_at=now,
        )


class FollowedPods:
    def __init__(self) -> None:
        self._pods: dict[str, FollowedPod] = {}
        self._by_topic: dict[str, str] = {}

    def __contains__(self, pod_id: object) -> bool:
        return pod_id in self._pods

    def __iter__(self) -> Iterator[FollowedPod]:
        """A snapshot: callers may add and remove pods while iterating."""
        return iter(list(self._pods.values()))

    def get(self, pod_id: str) -> FollowedPod | None:
        return self._pods.get(pod_id)

    def by_topic(self, topic: str) -> FollowedPod | None:
        pod_id = self._by_topic.get(topic)
        return None if pod_id is None else self._pods.get(pod_id)

    def check(self, info: PodInfo) -> None:
        """Raise `TopicTaken` if following `info` would take another pod's bound topic."""
        if info.kv_events.mode != "bind":
            return
        holder = self._by_topic.get(info.kv_events.topic)
        if holder is not None and holder != info.id:
            raise TopicTaken(
                f"pod {info.id}: topic {info.kv_events.topic!r} already names pod {holder}"
            )

    def add(self, info: PodInfo) -> FollowedPod:
        """Follow `info` (its id must not be followed yet); raises `TopicTaken`."""
        self.check(info)
        pod = self._pods[info.id] = FollowedPod(info)
        if info.kv_events.mode == "bind":
            self._by_topic[info.kv_events.topic] = info.id
        return pod

    def pop(self, pod_id: str) -> FollowedPod | None:
        pod = self._pods.pop(pod_id, None)
        if pod is not None and self._by_topic.get(pod.info.kv_events.topic) == pod_id:
            del self._by_topic[pod.info.kv_events.topic]
        return pod


def watched(coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
    """A task whose failure is logged when it happens: nobody awaits these until shutdown,
    and a subscription that died silently would leave its pod invisible for good."""
    task = asyncio.create_task(coro, name=name)
    task.add_done_callback(_log_failure)
    return task


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("%s stopped: %r", task.get_name(), exc, exc_info=exc)
