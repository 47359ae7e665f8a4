"""The decode side: from (bootstrap address, room) to the prefill ranks to pull KV from.

It follows SGLang's decode (PROTOCOLS §1.5): fetch the topology snapshot once per
address and retry an unready one every `retry_interval` up to `max_tries`; compute the
target ranks; choose the prefill DP rank (explicit, 0, room % dp, or by polling
/query_dp_ranks); look each rank up once and cache it; heartbeat every cached address
and forget it after `health_failures` failed beats in a row. Every failure is a
`ResolveError` naming the stage and the address, so a request that cannot start says
where it stopped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Literal

import httpx
from pydantic import ValidationError

from bootstrap.mapping import (
    DecodeTopology,
    IncompatibleTopology,
    RankMapping,
    target_ranks,
)
from bootstrap.protocol import (
    ROUTE_PARAMS,
    SNAPSHOT_QUERY,
    Coordinate,
    RankAddress,
    Topology,
)
from bootstrap.room_poller import RoomPoller, RoomWaitFailed
from kvplumbing.clock import Clock, Sleep
from kvplumbing.describe import describe_answer, describe_error
from kvplumbing.validation import validation_message

__all__ = [
    "DecodeResolver",
    "DecodeTopology",
    "RankMapping",
    "ResolveError",
    "ResolvedProducer",
    "ResolvedRank",
    "target_ranks",
]

log = logging.getLogger(__name__)

Stage = Literal["topology", "rank", "dp_rank"]


class ResolveError(Exception):
    """A decode could not find its producer; `stage` says which step failed."""

    def __init__(
        self, stage: Stage, bootstrap_url: str, message: str, *, invalid: bool = False
    ) -> None:
        super().__init__(f"bootstrap {stage} stage failed at {bootstrap_url}: {message}")
        self.stage: Stage = stage
        self.bootstrap_url = bootstrap_url
        self.message = message
        self.invalid = invalid
        """The directory answered, but with something a decode cannot use (vs. not yet)."""


@dataclass(frozen=True, slots=True)
class ResolvedRank:
    coordinate: Coordinate
    address: RankAddress
    is_dummy: bool
    """Connected only so the prefill's transfer state completes (MLA); sends no KV."""


@dataclass(frozen=True, slots=True)
class ResolvedProducer:
    """Everything a decode rank needs to start pulling one room's KV."""

    bootstrap_url: str
    topology: Topology
    dp_rank: int
    mapping: RankMapping
    ranks: tuple[ResolvedRank, ...]


class DecodeResolver:
    """Per-address caches of topology and rank addresses, shared by all of a decode's requests."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        *,
        retry_interval: float = 1.0,
        max_tries: int = 15,
        health_interval: float = 5.0,
        health_failures: int = 2,
        timeout: float = 5.0,
        health_timeout: float = 3.0,
        room_poll_interval: float = 0.05,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
        on_address_lost: Callable[[str], object] | None = None,
    ) -> None:
        if max_tries < 1 or health_failures < 1:
            raise ValueError("max_tries and health_failures must be at least 1")
        self._client = client
        self._retry_interval = retry_interval
        self._max_tries = max_tries
        self._health_interval = health_interval
        self._health_failures = health_failures
        self._timeout = timeout
        self._health_timeout = health_timeout
        self._room_poll_interval = room_poll_interval
        self._clock = clock
        self._sleep = sleep
        self._on_address_lost = on_address_lost
        self._topologies: dict[str, Topology] = {}
        self._addresses: dict[str, dict[Coordinate, RankAddress]] = {}
        self._fetching: dict[str, asyncio.Task[Topology]] = {}
        self._pollers: dict[str, RoomPoller] = {}
        self._generation: dict[str, int] = {}
        self._failures: dict[str, int] = {}
        self._health_task: asyncio.Task[None] | None = None

    async def resolve(
        self,
        bootstrap_url: str,
        decode: DecodeTopology,
        room: int,
        *,
        explicit_dp_rank: int | None = None,
        dp_timeout: float = 300.0,
    ) -> ResolvedProducer:
        """The prefill ranks `decode` pulls `room` from; `dp_timeout` bounds the room poll
        (SGLang's bootstrap timeout is 300 s)."""
        topology = await self.topology(bootstrap_url)
        try:
            mapping = target_ranks(topology, decode)
        except IncompatibleTopology as exc:
            raise ResolveError("topology", bootstrap_url, str(exc)) from None
        dp_rank = await self._dp_rank(bootstrap_url, topology, room, explicit_dp_rank, dp_timeout)
        coords = [Coordinate(dp_rank, cp, tp, pp) for cp, tp, pp in mapping.targets()]
        addresses = await asyncio.gather(*(self._rank(bootstrap_url, c) for c in coords))
        return ResolvedProducer(
            bootstrap_url=bootstrap_url,
            topology=topology,
            dp_rank=dp_rank,
            mapping=mapping,
            ranks=tuple(
                ResolvedRank(c, a, c.tp_rank in mapping.dummy_tp_ranks)
                for c, a in zip(coords, addresses, strict=True)
            ),
        )

    async def topology(self, bootstrap_url: str) -> Topology:
        """The address's snapshot, fetched once however many requests wait for it."""
        cached = self._topologies.get(bootstrap_url)
        if cached is not None:
            return cached
        task = self._fetching.get(bootstrap_url)
        if task is None:
            task = asyncio.create_task(
                self._fetch_topology(bootstrap_url), name=f"topology {bootstrap_url}"
            )
            self._fetching[bootstrap_url] = task
            task.add_done_callback(partial(self._fetch_done, bootstrap_url))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            waiter = asyncio.current_task()
            if task.cancelled() and waiter is not None and not waiter.cancelling():
                raise ResolveError("topology", bootstrap_url, "the resolver stopped") from None
            raise

    def _fetch_done(self, bootstrap_url: str, task: asyncio.Task[Topology]) -> None:
        if self._fetching.get(bootstrap_url) is task:
            del self._fetching[bootstrap_url]
        if not task.cancelled():
            task.exception()  # retrieved: every waiter got it, or none is left to care

    async def _fetch_topology(self, url: str) -> Topology:
        generation = self._generation.get(url, 0)
        last = "no answer"
        for attempt in range(self._max_tries):
            if attempt:
                await self._sleep(self._retry_interval)
            try:
                response = await self._client.get(
                    f"{url}/route", params=SNAPSHOT_QUERY, timeout=self._timeout
                )
            except httpx.HTTPError as exc:
                last = describe_error(exc)
                continue
            if response.status_code != 200:
                last = describe_answer(response)
                continue
            try:
                topology = Topology.model_validate_json(response.content)
            except ValidationError as exc:
                message = f"invalid topology snapshot: {validation_message(exc)}"
                raise ResolveError("topology", url, message, invalid=True) from None
            if self._generation.get(url, 0) == generation:
                self._topologies[url] = topology
            log.debug("topology of %s: %s", url, topology)
            return topology
        raise ResolveError(
            "topology",
            url,
            f"not available after {self._max_tries} tries {self._retry_interval:g}s apart; "
            f"last answer: {last}",
        )

    async def _dp_rank(
        self,
        url: str,
        topology: Topology,
        room: int,
        explicit: int | None,
        dp_timeout: float,
    ) -> int:
        dp_size = topology.dp_size
        if explicit is not None:
            if not 0 <= explicit < dp_size:
                raise ResolveError(
                    "dp_rank", url, f"explicit prefill dp rank {explicit} outside [0, {dp_size})"
                )
            return explicit
        if dp_size == 1:
            return 0
        if topology.follow_bootstrap_room:
            return room % dp_size
        poller = self._pollers.get(url)
        if poller is None:
            poller = RoomPoller(
                self._client,
                url,
                interval=self._room_poll_interval,
                timeout=self._timeout,
                clock=self._clock,
                sleep=self._sleep,
            )
            self._pollers[url] = poller
        try:
            dp_rank = await poller.wait(room, self._clock() + dp_timeout)
        except RoomWaitFailed as exc:
            raise ResolveError("dp_rank", url, str(exc)) from None
        if not 0 <= dp_rank < dp_size:
            raise ResolveError(
                "dp_rank",
                url,
                f"room {room} is mapped to dp rank {dp_rank}, outside [0, {dp_size})",
            )
        return dp_rank

    async def _rank(self, url: str, coord: Coordinate) -> RankAddress:
        known = self._addresses.get(url, {}).get(coord)
        if known is not None:
            return known
        generation = self._generation.get(url, 0)
        try:
            response = await self._client.get(
                f"{url}/route",
                params=dict(zip(ROUTE_PARAMS, coord, strict=True)),
                timeout=self._timeout,
            )
        except httpx.HTTPError as exc:
            raise ResolveError("rank", url, f"{coord}: {describe_error(exc)}") from None
        if response.status_code != 200:
            raise ResolveError("rank", url, f"{coord}: {describe_answer(response)}")
        try:
            address = RankAddress.model_validate_json(response.content)
        except ValidationError as exc:
            message = f"{coord}: invalid rank answer: {validation_message(exc)}"
            raise ResolveError("rank", url, message) from None
        if self._generation.get(url, 0) == generation:
            self._addresses.setdefault(url, {})[coord] = address
        return address

    def invalidate(self, bootstrap_url: str) -> None:
        """Forget everything known about an address; the next request fetches it anew."""
        self._topologies.pop(bootstrap_url, None)
        self._addresses.pop(bootstrap_url, None)
        self._failures.pop(bootstrap_url, None)
        self._generation[bootstrap_url] = self._generation.get(bootstrap_url, 0) + 1

    def cached(self, bootstrap_url: str) -> bool:
        return bootstrap_url in self._topologies

    async def check_health_once(self) -> list[str]:
        """One heartbeat to every cached address; returns the addresses just dropped."""
        urls = list(self._topologies)
        beats = await asyncio.gather(*(self._beat(url) for url in urls))
        dropped = []
        for url, ok in zip(urls, beats, strict=True):
            if ok:
                self._failures.pop(url, None)
                continue
            failures = self._failures.get(url, 0) + 1
            self._failures[url] = failures
            if failures >= self._health_failures:
                log.warning(
                    "bootstrap %s failed %d heartbeats in a row: dropping its cached ranks",
                    url,
                    failures,
                )
                self.invalidate(url)
                dropped.append(url)
        for url in dropped:
            if self._on_address_lost is not None:
                self._on_address_lost(url)
        return dropped

    async def _beat(self, url: str) -> bool:
        try:
            response = await self._client.get(f"{url}/health", timeout=self._health_timeout)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    def start(self) -> None:
        """Heartbeat cached addresses every `health_interval` until `stop()`."""
        if self._health_task is not None:
            raise RuntimeError("resolver health watch already started")
        self._health_task = asyncio.create_task(self._watch_health(), name="bootstrap heartbeat")

    async def _watch_health(self) -> None:
        while True:
            await self._sleep(self._health_interval)
            await self.check_health_once()

    async def stop(self) -> None:
        """End the heartbeat and every background fetch; waiting resolves get an error."""
        tasks: list[asyncio.Task[object]] = [*self._fetching.values()]
        tasks += [p.task for p in self._pollers.values() if p.task is not None]
        if self._health_task is not None:
            tasks.append(self._health_task)
            self._health_task = None
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        self._pollers.clear()
