"""Discovered workers in the gateway's pool: Kubernetes pods by label selectors, or a
watched file (`globalkv.discovery`), followed for as long as the gateway runs.

Each snapshot the source publishes is diffed against what discovery added before
(`globalkv.discovery.model.follow`): removals first, through the gateway's `remove_worker`
(the router forgets the worker, the monitor unregisters a prefill from the index), then
additions through `add_worker` (the monitor checks its health, reads its bootstrap
directory and registers a prefill with the index, as for a worker given on the command
line). Only what discovery added is ever removed: a worker given on the command line or
with `POST /workers` at the same URL stays, and its discovered twin is skipped with a log
line. A request in flight on a removed worker finishes on it (its connection is its own);
new requests go to the workers that remain.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

from gateway.settings.workers import DiscoveryConfig, WorkerSpec
from gateway.workers.pool import DuplicateWorker, Worker
from globalkv.discovery.files import FileSource
from globalkv.discovery.kube_source import open_source
from globalkv.discovery.kubernetes import KubernetesDiscovery, parse_selector
from globalkv.discovery.model import Changes, DiscoveredWorker, Source, follow

log = logging.getLogger(__name__)


class Workers(Protocol):
    """What following needs of the gateway (`gateway.serving.service.Gateway`)."""

    def add_worker(self, spec: WorkerSpec) -> Worker: ...

    async def remove_worker(self, worker_id: str) -> Worker | None: ...


def discovery_source(config: DiscoveryConfig) -> Source | None:
    """The source `config` names, not yet started; None when discovery is off. Without the
    `kubernetes` extra, Kubernetes discovery raises `MissingExtra` (one line)."""
    if config.worker_file is not None:
        return FileSource(Path(config.worker_file))
    if not config.service_discovery:
        return None
    settings = KubernetesDiscovery(
        prefill_selector=parse_selector(config.prefill_selector),
        decode_selector=parse_selector(config.decode_selector),
        port=config.port,
        decode_port=config.decode_port,
        namespace=config.namespace,
        bootstrap_port_annotation=config.bootstrap_port_annotation,
    )
    return open_source(settings)


class Follower:
    """Applies a source's changes to the gateway's workers."""

    def __init__(self, workers: Workers) -> None:
        self._workers = workers
        self._added: dict[DiscoveredWorker, str] = {}
        """Each discovered worker this follower added, with its id in the pool."""

    async def run(self, source: Source) -> None:
        """Follow `source` (started by the caller) until its snapshots end."""
        await follow(source.snapshots(), self.apply)

    async def apply(self, step: Changes) -> None:
        for gone in step.removed:
            worker_id = self._added.pop(gone, None)
            if worker_id is not None:
                await self._workers.remove_worker(worker_id)
        for new in step.added:
            spec = WorkerSpec(url=new.url, role=new.role, bootstrap_port=new.bootstrap_port)
            try:
                worker = self._workers.add_worker(spec)
            except DuplicateWorker:
                log.warning(
                    "discovery: %s (%s) is already a worker, added by other means; left as it is",
                    new.id,
                    new.url,
                )
                continue
            self._added[new] = worker.id
