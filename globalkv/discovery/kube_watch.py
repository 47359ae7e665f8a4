"""Kubernetes pods as worker snapshots: list, then watch from the list's resourceVersion,
one list-watch per selector (the API server filters by labels; it cannot OR two selectors).

Each selector's stream keeps the workers it last knew and changes them only on what the
API server says:

- a watch that ends, drops or cannot reconnect (the API server restarting, a load
  balancer cutting idle connections) resumes from the last resourceVersion seen, after a
  capped, jittered backoff while it fails, and the workers stay as they were meanwhile:
  an unreachable API server says nothing about the pods;
- 410 Gone (the resourceVersion fell out of the server's history) is answered with a new
  list, and the list replaces the stream's workers whole: what it no longer has is
  removed, what it still has stays, so nothing is removed and added back;
- bookmarks are asked for, and carry the resourceVersion forward while nothing matching
  changes, so a resumed watch rarely finds its version gone;
- an object the client cannot decode (no real API server sends one: it validates what it
  stores; a broken proxy might) ends the watch and is answered, after the backoff, with a
  new list, which succeeds once the object is gone; a decodable pod that states something
  unusable is skipped, logged once and counted (`rejected`).

lightkube is the client: asyncio-native, on httpx2 (installed already, for the tokenizers'
hub client), typed (strict mypy checks every pod field read here) and small, where
kubernetes_asyncio brings aiohttp and generated models and kr8s hands back untyped dicts.
Its watch has no parameter for `allowWatchBookmarks`, so `_watch` builds the request
lightkube's `watch` builds, plus that parameter; the tests check the parameter is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import Counter
from collections.abc import AsyncGenerator, Callable, Coroutine, Iterator, Mapping
from typing import Any, Self

import httpx2
from lightkube import ApiError, AsyncClient
from lightkube.core.client import LabelSelector
from lightkube.core.exceptions import ConfigError, NotReadyError
from lightkube.core.generic_client import ALL_NS
from lightkube.resources.core_v1 import Pod
from lightkube.types import on_error_raise

from globalkv.discovery.kubernetes import (
    KubernetesDiscovery,
    PodRejected,
    pod_worker,
    selector_query,
)
from globalkv.discovery.model import DiscoveredWorker, Role, Source
from kvplumbing.clock import Sleep

log = logging.getLogger(__name__)

LIST_CHUNK = 500
"""Pods per list page (client-go's reflector pages by 500 too)."""


class _Gone(Exception):
    """The resourceVersion is no longer in the API server's history: list again."""


class _Stream:
    """One selector's workers, by pod id, and how its list-watch is faring."""

    def __init__(self, role: Role, labels: Mapping[str, str]) -> None:
        self.role = role
        self.labels = dict(labels)
        self.listed = False
        self.version: str | None = None
        """Where the next watch resumes; None: list first."""
        self.failures = 0
        self.workers: dict[str, DiscoveredWorker] = {}
        self.refused: dict[str, str] = {}
        """Pod id -> why it was refused, so a pod is logged once per reason, not per event."""


class KubernetesSource(Source):
    """Watches pods by `KubernetesDiscovery` and publishes the workers they make.

    `async with` starts the watches (and closes the client it made itself on exit);
    `snapshots()` yields each new worker set until then. `counts` tallies lists, watches,
    gone versions and failures; `rejected` tallies refused pods by what was wrong.
    """

    def __init__(
        self,
        settings: KubernetesDiscovery,
        *,
        client: AsyncClient | None = None,
        sleep: Sleep = asyncio.sleep,
        draw: Callable[[], float] = random.random,
    ) -> None:
        super().__init__()
        self.settings = settings
        self.counts: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.left_out = 0
        """Worker pods the last snapshot left out: past `max_workers`, or a taken address."""
        self._client = client
        self._owns_client = client is None
        self._sleep = sleep
        self._draw = draw
        selectors: tuple[tuple[Role, Mapping[str, str]], ...] = (
            ("prefill", settings.prefill_selector),
            ("decode", settings.decode_selector),
        )
        self._streams = [_Stream(role, labels) for role, labels in selectors if labels]

    def _loops(self) -> list[Coroutine[Any, Any, None]]:
        assert self._client is not None  # made on entry
        return [self._follow(self._client, stream) for stream in self._streams]

    async def __aenter__(self) -> Self:
        if self._client is None:
            try:
                self._client = AsyncClient()
            except ConfigError as error:
                raise ValueError(f"Kubernetes service discovery: {error}") from None
        return await super().__aenter__()

    async def _release(self) -> None:
        if self._owns_client and self._client is not None:
            await self._client.close()

    async def _follow(self, client: AsyncClient, stream: _Stream) -> None:
        """List and watch until cancelled, resuming and relisting as the module says."""
        while True:
            try:
                if stream.version is None:
                    await self._list(client, stream)
                await self._watch_for_a_while(client, stream)
            except _Gone:
                self.counts["gone"] += 1
                log.info("discovery: %s pods: version gone, listing again", stream.role)
                stream.version = None
            except (httpx2.HTTPError, OSError) as error:
                await self._pause(stream, _describe(error))
            except Exception as error:  # an object or answer the client could not take
                log.debug("discovery: %s pods failed", stream.role, exc_info=True)
                stream.version = None  # resuming would read the same object again
                await self._pause(stream, f"{type(error).__name__}: {error}")

    async def _pause(self, stream: _Stream, why: str) -> None:
        self.counts["failures"] += 1
        pause = self.settings.backoff.delay(stream.failures, self._draw())
        stream.failures += 1
        log.warning(
            "discovery: %s pods: %s; keeping %d workers, trying again in %.1f s",
            stream.role,
            why,
            len(stream.workers),
            pause,
        )
        await self._sleep(pause)

    async def _list(self, client: AsyncClient, stream: _Stream) -> None:
        """List the stream's pods and replace its workers with them."""
        labels: LabelSelector = dict(stream.labels)
        pods = client.list(Pod, namespace=self._namespace, labels=labels, chunk_size=LIST_CHUNK)
        seen: dict[str, DiscoveredWorker] = {}
        listed: set[str] = set()
        with _gone_is_raised():
            async for pod in pods:
                key = _pod_id(pod)
                if key is not None:
                    listed.add(key)
                worker = self._admit(stream, pod)
                if worker is not None:
                    seen[worker.id] = worker
        try:
            stream.version = pods.resourceVersion
        except NotReadyError:
            raise ValueError("the API server listed pods without a resourceVersion") from None
        self.counts["lists"] += 1
        stream.workers = seen
        stream.refused = {key: why for key, why in stream.refused.items() if key in listed}
        stream.listed = True
        stream.failures = 0
        await self._publish()

    async def _watch_for_a_while(self, client: AsyncClient, stream: _Stream) -> None:
        """Apply watch events from the stream's version until the watch timeout."""
        assert stream.version is not None  # listed first
        self.counts["watches"] += 1
        timeout = self.settings.watch_timeout
        with contextlib.suppress(TimeoutError), _gone_is_raised():
            async with (
                asyncio.timeout(timeout + 5),
                contextlib.aclosing(self._watch(client, stream, stream.version)) as events,
            ):
                async for kind, pod in events:
                    stream.failures = 0
                    if pod.metadata is not None and pod.metadata.resourceVersion:
                        stream.version = pod.metadata.resourceVersion
                    if kind != "BOOKMARK" and self._apply(stream, kind, pod):
                        await self._publish()

    def _watch(
        self, client: AsyncClient, stream: _Stream, version: str
    ) -> AsyncGenerator[tuple[str, Pod]]:
        generic = client._client
        request = generic.prepare_request(
            "list",
            res=Pod,
            namespace=self._namespace,
            watch=True,
            params={
                "labelSelector": selector_query(stream.labels),
                "resourceVersion": version,
                "allowWatchBookmarks": "true",
                "timeoutSeconds": str(max(1, int(self.settings.watch_timeout))),
            },
        )
        events: AsyncGenerator[tuple[str, Pod]] = generic.watch(request, on_error=on_error_raise)
        return events

    def _apply(self, stream: _Stream, kind: str, pod: Pod) -> bool:
        """Apply one ADDED, MODIFIED or DELETED event; whether the stream's workers changed."""
        key = _pod_id(pod)
        if key is None:
            return False
        before = stream.workers.get(key)
        worker = None
        if kind == "DELETED":
            stream.refused.pop(key, None)
        else:
            worker = self._admit(stream, pod)
        if worker is None:
            stream.workers.pop(key, None)
        else:
            stream.workers[key] = worker
        return worker != before

    def _admit(self, stream: _Stream, pod: Pod) -> DiscoveredWorker | None:
        """The worker `pod` is for this stream, None if it is none of the stream's."""
        key = _pod_id(pod)
        try:
            worker = pod_worker(self.settings, pod)
        except PodRejected as refused:
            reason = str(refused)
            if key is None or stream.refused.get(key) != reason:
                self.rejected[refused.kind] += 1
                log.warning("discovery: skipping %s", reason)
            if key is not None:
                stream.refused[key] = reason
            return None
        if key is not None:
            stream.refused.pop(key, None)
        if worker is None or worker.role != stream.role:
            return None  # a pod both selectors match is the prefill stream's
        return worker

    async def _publish(self) -> None:
        """Merge the streams that have listed into one snapshot, capped, unique by URL."""
        merged: dict[str, DiscoveredWorker] = {}
        for stream in self._streams:  # prefill first: its view wins a pod both claim
            if stream.listed:
                for worker in stream.workers.values():
                    merged.setdefault(worker.id, worker)
        chosen: dict[str, DiscoveredWorker] = {}
        for worker in sorted(merged.values()):
            if worker.url not in chosen and len(chosen) < self.settings.max_workers:
                chosen[worker.url] = worker
        left_out = len(merged) - len(chosen)
        if left_out and left_out != self.left_out:
            log.warning(
                "discovery: %d of %d pods left out (an address another pod has, or past %d)",
                left_out,
                len(merged),
                self.settings.max_workers,
            )
        self.left_out = left_out
        await self._cell.publish(frozenset(chosen.values()))

    @property
    def _namespace(self) -> str:
        return self.settings.namespace or ALL_NS


def _pod_id(pod: Pod) -> str | None:
    meta = pod.metadata
    if meta is None or not meta.name or not meta.namespace:
        return None
    return f"{meta.namespace}/{meta.name}"


@contextlib.contextmanager
def _gone_is_raised() -> Iterator[None]:
    """410 Gone, as an ERROR event's Status or as the HTTP answer, raised as `_Gone`."""
    try:
        yield
    except ApiError as error:
        if error.status.code == 410:
            raise _Gone from error
        raise
    except httpx2.HTTPStatusError as error:
        if error.response.status_code == 410:
            raise _Gone from error
        raise


def _describe(error: BaseException) -> str:
    if isinstance(error, ApiError):
        return f"the API server answered {error.status.code}: {error.status.message}"
    if isinstance(error, httpx2.HTTPStatusError):
        return f"the API server answered {error.response.status_code}"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
