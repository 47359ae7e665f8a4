"""What discovery tells its consumers: the whole set of workers that should exist, each time
that set changes, rather than a stream of additions and removals.

A source publishes a `Snapshot` only when it knows the complete truth: after a successful
Kubernetes list (and each watch event applied on top of it), or after a file that parsed
and validated. A consumer diffs each snapshot against what it applied (`changes`,
`follow`). The rule this buys is "remove only what the source of truth no longer has":

- a relist after 410 Gone, a watch that dropped and came back, an API server restart or
  the consumer's own restart all end in the same place, a fresh snapshot, and the diff
  against the applied set is right whatever events were missed or replayed in between;
- a source that cannot reach its truth publishes nothing, so the consumer keeps what it
  has: there is no "empty because unreachable" set to be mistaken for "all gone";
- snapshots coalesce: a consumer that falls behind reads only the newest, so a burst of
  pod churn costs no queue, and an Envoy endpoint picker gets the full set it needs.

A worker is identified by its value: a pod that comes back under the same name with a new
IP, or a prefill relabelled decode, is the old worker removed and a new one added.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, Self

from kvplumbing.tasks import cancel_and_wait

log = logging.getLogger(__name__)

Role = Literal["prefill", "decode"]


@dataclass(frozen=True, slots=True, order=True)
class DiscoveredWorker:
    """One worker as a source of truth states it.

    `id` names it in the source (`namespace/name` for a pod, the entry's id or its URL for
    a file); `url` is `http://ip:port`, unique within a snapshot. `bootstrap_port` is for a
    prefill only (None: the engine's own); `model` is what the source says it serves, if it
    says.
    """

    id: str
    url: str
    role: Role
    bootstrap_port: int | None = None
    model: str | None = None


Snapshot = frozenset[DiscoveredWorker]
"""Every worker that should exist now, by the source's account."""


@dataclass(frozen=True, slots=True)
class Changes:
    """What takes the applied set to a snapshot. Apply `removed` before `added`: a new pod
    may have taken the address of one that went away, and a worker's id in the gateway is
    its address."""

    added: tuple[DiscoveredWorker, ...]
    removed: tuple[DiscoveredWorker, ...]

    def __bool__(self) -> bool:
        return bool(self.added or self.removed)


def changes(before: Snapshot, after: Snapshot) -> Changes:
    """The difference between two snapshots, each side sorted so the order is stable."""
    return Changes(added=tuple(sorted(after - before)), removed=tuple(sorted(before - after)))


class SnapshotCell:
    """The newest snapshot a source has published, for any number of readers.

    A reader sees the current snapshot at once (if there is one), then each newer one; one
    that reads slowly skips to the newest. `close` ends every reader's iteration.
    """

    def __init__(self) -> None:
        self._snapshot: Snapshot | None = None
        self._version = 0
        self._closed = False
        self._changed = asyncio.Condition()

    @property
    def current(self) -> Snapshot | None:
        """The newest snapshot, None until the source first knew its truth."""
        return self._snapshot

    async def publish(self, snapshot: Snapshot) -> bool:
        """Make `snapshot` the newest; False (and nothing woken) when it is the same set."""
        if snapshot == self._snapshot:
            return False
        async with self._changed:
            self._snapshot = snapshot
            self._version += 1
            self._changed.notify_all()
        return True

    async def close(self) -> None:
        async with self._changed:
            self._closed = True
            self._changed.notify_all()

    async def updates(self) -> AsyncIterator[Snapshot]:
        seen = 0
        while True:
            async with self._changed:
                while not self._closed and self._version == seen:
                    await self._changed.wait()
                if self._closed:
                    return
                seen, snapshot = self._version, self._snapshot
            assert snapshot is not None  # a version past 0 was published with a snapshot
            yield snapshot


class Source:
    """What every source shares: the loops it runs while `async with` lasts, and the
    snapshots they publish. `snapshots()` ends when the `async with` does."""

    def __init__(self) -> None:
        self._cell = SnapshotCell()
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def current(self) -> Snapshot | None:
        """The workers last published; None until the source first knew its truth."""
        return self._cell.current

    def snapshots(self) -> AsyncIterator[Snapshot]:
        return self._cell.updates()

    def _loops(self) -> list[Coroutine[Any, Any, None]]:
        """The loops to run, each until cancelled."""
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        self._tasks = [asyncio.create_task(loop) for loop in self._loops()]
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await cancel_and_wait(self._tasks)
        await self._cell.close()
        await self._release()

    async def _release(self) -> None:
        """Let go of what the loops used, once they have ended."""


Apply = Callable[[Changes], Awaitable[None]]


async def follow(snapshots: AsyncIterable[Snapshot], apply: Apply) -> Snapshot:
    """Hand `apply` the changes from each snapshot to the next, starting from nothing, until
    the snapshots end; the set applied last is returned.

    What `apply` raises ends the following: the consumer decides whether a worker it could
    not add is worth stopping for. A consumer that starts with workers of its own (command
    line flags) keeps them: only what a snapshot brought is ever removed.
    """
    applied: Snapshot = frozenset()
    async for snapshot in snapshots:
        step = changes(applied, snapshot)
        if step:
            await apply(step)
            log.info(
                "discovery: %d workers (%d added, %d removed)",
                len(snapshot),
                len(step.added),
                len(step.removed),
            )
        applied = snapshot
    return applied
