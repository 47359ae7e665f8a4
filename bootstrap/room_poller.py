"""Waiting for the prefill to say which DP rank serves a room (PROTOCOLS §1.4).

When the prefill does not follow `bootstrap_room % dp_size`, the decode must ask the
directory until the prefill has registered the room. Many requests wait at once, so
one loop per address asks for all of them in each /query_dp_ranks call, as SGLang's
decode batches its pending requests, instead of one poll per request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import httpx
from pydantic import TypeAdapter, ValidationError

from bootstrap.protocol import MAX_QUERY_ROOMS
from kvplumbing.clock import Clock, Sleep
from kvplumbing.describe import describe_answer, describe_error
from kvplumbing.validation import validation_message

_ROOM_ANSWER = TypeAdapter(dict[int, int])


class RoomWaitFailed(Exception):
    """The room's DP rank did not arrive before the deadline, or waiting was stopped."""


class RoomPoller:
    """One /query_dp_ranks loop per address, asking for every room still awaited at once,
    as SGLang's decode batches its pending requests."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        url: str,
        *,
        interval: float,
        timeout: float,
        clock: Clock,
        sleep: Sleep,
    ) -> None:
        self._client = client
        self._url = url
        self._interval = interval
        self._timeout = timeout
        self._clock = clock
        self._sleep = sleep
        self._waiting: dict[int, list[tuple[float, asyncio.Future[int]]]] = {}
        self._last = "not registered yet"
        self.task: asyncio.Task[None] | None = None

    async def wait(self, room: int, deadline: float) -> int:
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        entry = (deadline, future)
        self._waiting.setdefault(room, []).append(entry)
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._run(), name=f"rooms {self._url}")
        try:
            return await future
        finally:
            waiters = self._waiting.get(room)
            if waiters is not None and entry in waiters:
                waiters.remove(entry)
                if not waiters:
                    del self._waiting[room]

    async def _run(self) -> None:
        try:
            while self._waiting:
                rooms = list(self._waiting)
                found: dict[int, int] = {}
                for start in range(0, len(rooms), MAX_QUERY_ROOMS):
                    found.update(await self._query(rooms[start : start + MAX_QUERY_ROOMS]))
                now = self._clock()
                for room in rooms:
                    self._settle(room, found.get(room), now)
                if self._waiting:
                    await self._sleep(self._interval)
        finally:
            for waiters in self._waiting.values():
                for _, future in waiters:
                    if not future.done():
                        future.set_exception(RoomWaitFailed("the resolver stopped"))
            self._waiting.clear()

    def _settle(self, room: int, dp_rank: int | None, now: float) -> None:
        waiters = self._waiting.pop(room, [])
        if dp_rank is not None:
            for _, future in waiters:
                if not future.done():
                    future.set_result(dp_rank)
            return
        pending = []
        for deadline, future in waiters:
            if deadline > now:
                pending.append((deadline, future))
            elif not future.done():
                message = f"room {room} got no dp rank registered in time; last: {self._last}"
                future.set_exception(RoomWaitFailed(message))
        if pending:
            self._waiting[room] = pending

    async def _query(self, rooms: Sequence[int]) -> dict[int, int]:
        try:
            response = await self._client.post(
                f"{self._url}/query_dp_ranks",
                json={"bootstrap_rooms": list(rooms)},
                timeout=self._timeout,
            )
        except httpx.HTTPError as exc:
            self._last = describe_error(exc)
            return {}
        if response.status_code != 200:
            self._last = describe_answer(response)
            return {}
        try:
            found: dict[int, int] = _ROOM_ANSWER.validate_json(response.content)
        except ValidationError as exc:
            self._last = f"invalid /query_dp_ranks answer: {validation_message(exc)}"
            return {}
        return found
