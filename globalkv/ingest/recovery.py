"""Rebuilding what the index's store lost: the sources named, and the registry with them;
and the sources whose writes the index refuses for now.

When the index reports lost data (`IndexDataLost` from a worker's write), the worker of
every source lost (all, when the index cannot name them) rebuilds it, and `ready` stays
False until all are done, so the API answers 503 instead of a lookup against a
half-empty index. When the whole store went, the pod registry kept beside the index went
with it: the pods this indexer follows are written back.

A source whose batch the index refuses for now (Redis unreachable, or full under
`noeviction`) holds it and retries; `held` names those sources and the last refusal, so
`/health` says the index is behind (degraded) and why, rather than ok.
"""

from __future__ import annotations

import logging
from collections.abc import Set

from globalkv.index.base import IndexUnavailable, Source
from globalkv.ingest.followed import FollowedPods
from globalkv.ingest.tasks import Background
from globalkv.metrics import IngestMetrics
from globalkv.registry import Registry

log = logging.getLogger(__name__)


class Recovery:
    """The sources being rebuilt; each worker's `writes.Resyncs`."""

    def __init__(
        self,
        pods: FollowedPods,
        registry: Registry,
        metrics: IngestMetrics,
        background: Background,
    ) -> None:
        self._pods = pods
        self._registry = registry
        self._metrics = metrics
        self._background = background
        self._resyncing: set[Source] = set()
        self.held: dict[Source, str] = {}
        """Sources whose next batch the index refused, with the refusal, until it takes one."""

    @property
    def ready(self) -> bool:
        """False while sources are being rebuilt after the index lost their data."""
        return not self._resyncing

    @property
    def resyncing(self) -> Set[Source]:
        return self._resyncing

    def data_lost(self, source: Source, lost: frozenset[Source] | None) -> None:
        """Rebuild the sources lost; when the whole index was (`lost` None), every source,
        and write our pods back to the registry, which went with it."""
        for worker in self._pods.workers():
            if lost is not None and worker.source not in lost:
                continue
            if worker.source not in self._resyncing:
                self._resyncing.add(worker.source)
                worker.request_resync()
        self._metrics.resyncing.set(len(self._resyncing))
        if lost is None:
            self._background.spawn(self.restore_registry(), "restoring the pod registry")

    def resynced(self, source: Source) -> None:
        self._resyncing.discard(source)
        self._metrics.resyncing.set(len(self._resyncing))
        if not self._resyncing:
            log.info("resync complete")

    def holding(self, source: Source, reason: str) -> None:
        """The index refused `source`'s write for now (`reason`): it is held and retried."""
        self.held[source] = reason
        self._metrics.held.set(len(self.held))

    def released(self, source: Source) -> None:
        """The index took `source`'s write again."""
        if self.held.pop(source, None) is not None:
            self._metrics.held.set(len(self.held))

    def forget(self, sources: Set[Source]) -> None:
        """These sources are no longer followed: nothing of theirs is being rebuilt or held."""
        self._resyncing -= sources
        for source in sources:
            self.held.pop(source, None)
        self._metrics.resyncing.set(len(self._resyncing))
        self._metrics.held.set(len(self.held))

    async def restore_registry(self) -> None:
        """Write back every pod we follow after the registry's store lost them."""
        try:
            for pod in self._pods:
                await self._registry.put(pod.info)
            await self._registry.mark()
        except IndexUnavailable as exc:
            log.warning("could not restore the pod registry yet: %s", exc)
