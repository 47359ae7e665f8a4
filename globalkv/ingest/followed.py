"""The pods an indexer follows, each with its source workers and tasks, by id and by topic,
and what their workers have applied.

The bound SUB knows a message's pod only by its topic, so a topic names one pod at most:
a second pod claiming a topic another followed pod holds is refused (`TopicTaken`), where
it would otherwise take that pod's events from it without a word.

A pod's reported state says only what the indexer knows (`registry.PodState`): listening
is not receiving, and a task that died is not a subscription.

Waiting on a source (`wait`, `applied`, `flush`) is how callers and tests learn that a
batch is visible without sleeping; a bind-mode source may appear only later, with its
first batch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Set
from dataclasses import dataclass, field

from globalkv.index.base import Source
from globalkv.ingest.publishers import Address
from globalkv.ingest.worker import SourceWorker
from globalkv.registry import PodInfo, PodState, SourceProgress


class TopicTaken(ValueError):
    """Another followed pod is named by this pod's bound topic."""


@dataclass(slots=True)
class FollowedPod:
    info: PodInfo
    workers: dict[int, SourceWorker] = field(default_factory=dict)
    """By DP rank; in bind mode a rank's worker appears with its first batch."""
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    """Its subscriptions and workers; none ends unless it failed or the pod stops."""
    home: frozenset[Address] | None = None
    """Bind mode: the addresses its messages may come from (`publishers`); None until its
    first accepted message when its registration names no host."""
    last_message: float = 0.0
    """time.monotonic() of its last message on the bound socket."""

    def accepts(self, address: Address | None) -> bool:
        """May a message for this pod come from `address` (None: ipc://, this machine)?"""
        return address is None or self.home is None or address in self.home

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
        self._worker_added = asyncio.Event()

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

    def add(self, info: PodInfo, home: frozenset[Address] | None = None) -> FollowedPod:
        """Follow `info` (its id must not be followed yet); raises `TopicTaken`."""
        self.check(info)
        pod = self._pods[info.id] = FollowedPod(info, home=home, last_message=time.monotonic())
        if info.kv_events.mode == "bind":
            self._by_topic[info.kv_events.topic] = info.id
        return pod

    def pop(self, pod_id: str) -> FollowedPod | None:
        pod = self._pods.pop(pod_id, None)
        if pod is not None and self._by_topic.get(pod.info.kv_events.topic) == pod_id:
            del self._by_topic[pod.info.kv_events.topic]
        return pod

    def add_worker(self, pod: FollowedPod, worker: SourceWorker) -> None:
        pod.workers[worker.source.dp_rank] = worker
        added, self._worker_added = self._worker_added, asyncio.Event()
        added.set()

    def workers(self) -> Iterator[SourceWorker]:
        for pod in self:
            yield from list(pod.workers.values())

    def worker(self, source: Source) -> SourceWorker | None:
        pod = self._pods.get(source.pod)
        return None if pod is None else pod.workers.get(source.dp_rank)

    async def applied(self, source: Source, seq: int, timeout: float = 10.0) -> None:
        """Return once `source`'s batch `seq` (or a later one) is visible in the index."""
        await self.wait(
            source, lambda s: s.last_seq is not None and s.last_seq >= seq, timeout=timeout
        )

    async def wait(
        self, source: Source, condition: Callable[[SourceProgress], bool], timeout: float = 10.0
    ) -> None:
        """Return once `condition` holds for `source`'s ingest state (TimeoutError after
        `timeout`); the source may appear later (bound socket)."""
        async with asyncio.timeout(timeout):
            while (worker := self.worker(source)) is None:
                await self._worker_added.wait()
            await worker.wait(condition)

    async def flush(self) -> None:
        """Return once every batch received so far has been applied (or dropped)."""
        await asyncio.gather(*(w.idle() for w in self.workers()))

    def states(self, *, listening: bool, resyncing: Set[Source]) -> dict[str, PodState]:
        """Each pod's state; `listening`: the bound SUB is up."""
        now = time.time()
        return {
            pod.info.id: pod.state(listening=listening, resyncing=resyncing, now=now)
            for pod in self
        }
