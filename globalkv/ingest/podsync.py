"""Follow the pod registry that others (gateways, other API calls) write to.

A change notification makes a pod's subscription start or stop within a moment; a
periodic reconciliation catches what notifications miss (pub/sub drops messages while a
subscriber reconnects, e.g. across a Redis restart). A registry that lost its data
(its marker is gone) is written back from what this indexer follows, rather than read as
"every pod was deleted".
"""

from __future__ import annotations

import asyncio
import logging

from globalkv.index.base import IndexUnavailable
from globalkv.ingest.config import EndpointRefused
from globalkv.ingest.followed import TopicTaken
from globalkv.ingest.service import IngestService
from globalkv.registry import PodInfo, Registry
from kvplumbing.tasks import cancel_and_wait

log = logging.getLogger(__name__)


class PodSync:
    def __init__(
        self,
        registry: Registry,
        service: IngestService,
        *,
        interval: float = 5.0,
        retry: float = 1.0,
    ) -> None:
        self.registry = registry
        self.service = service
        self.interval = interval
        self.retry = retry
        self.refused: dict[str, str] = {}
        """Pods of the registry this indexer refuses, with why: each is reported once,
        not at every reconciliation, and again only when the reason changes."""

    async def run(self) -> None:
        """Reconcile now and every `interval`, and apply notifications as they come."""
        watcher = asyncio.create_task(self._watch(), name="podsync watch")
        try:
            while True:
                try:
                    await self.reconcile()
                except IndexUnavailable as exc:
                    log.warning("pod registry unavailable: %s", exc)
                await asyncio.sleep(self.interval)
        finally:
            await cancel_and_wait([watcher])

    async def reconcile(self) -> None:
        """Make the followed pods equal to the registry's."""
        if not await self.registry.intact():
            log.warning("the pod registry lost its data; writing back the pods we follow")
            await self.service.recovery.restore_registry()
        await self.service.discovery.register_discovered()
        followed = {p.id for p in self.service.following.pods()}
        pods = await self.registry.list()
        for pod in pods:
            await self._follow(pod)
        listed = {p.id for p in pods}
        for pod_id in set(self.refused) - listed:
            del self.refused[pod_id]
        gone = followed - listed
        if gone and not await self.registry.intact():
            # Lost after the check above, before the list was read: what the list lacks
            # was not deleted. Asked after the list, "intact" vouches for what it read.
            log.warning("the pod registry lost its data; writing back the pods we follow")
            await self.service.recovery.restore_registry()
            gone = set()
        for pod_id in gone:
            log.info("pod %s left the registry; unsubscribing", pod_id)
            await self.service.following.remove(pod_id)
        await self.service.following.clear_removed()
        await self.service.publish_states()

    async def sync_one(self, pod_id: str) -> None:
        """A pod that is gone from a registry which lost its data was not removed: the
        whole registry is written back instead (a Redis restart notifies too)."""
        pod = await self.registry.get(pod_id)
        if pod is not None:
            await self._follow(pod)
            return
        self.refused.pop(pod_id, None)
        if pod_id not in {p.id for p in self.service.following.pods()}:
            return
        if not await self.registry.intact():
            await self.reconcile()
            return
        log.info("pod %s was removed from the registry; unsubscribing", pod_id)
        await self.service.following.remove(pod_id)

    async def _follow(self, pod: PodInfo) -> None:
        """A pod written by someone else that this indexer refuses (its topic names another
        pod, its endpoint's scheme is not allowed) is reported, and the others followed."""
        try:
            await self.service.following.add(pod)
        except (TopicTaken, EndpointRefused) as exc:
            reason = str(exc)
            if self.refused.get(pod.id) != reason:
                log.warning("not following a pod of the registry: %s", reason)
            self.refused[pod.id] = reason
            return
        if self.refused.pop(pod.id, None) is not None:
            log.info("pod %s of the registry is followed now", pod.id)

    async def _watch(self) -> None:
        while True:
            try:
                async for pod_id in self.registry.changes():
                    await self.sync_one(pod_id)
            except IndexUnavailable as exc:
                log.warning("pod registry notifications interrupted: %s", exc)
                await asyncio.sleep(self.retry)
