"""The prefill side: ranks announcing themselves to their instance's directory.

`register_rank` retries the way SGLang's prefill does (5 tries, 1 s x 2^n capped at
30 s, jittered down by up to 25 %, 5 s per try) but stops at once on a 4xx: a refusal
names a contradiction that retrying cannot fix. `KeepAlive` re-sends the registrations
periodically, so a directory that restarts empty (it persists nothing) fills up again
without restarting the ranks. Against a real SGLang directory it would inflate SGLang's
PUT counter, which SGLang takes for readiness; use it with globalkv's directory only.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Sequence

import httpx

from bootstrap.protocol import RankRegistration, RoomRegistration
from kvplumbing.backoff import Backoff
from kvplumbing.clock import Sleep
from kvplumbing.describe import describe_answer, describe_error

log = logging.getLogger(__name__)

SGLANG_JITTER = (0.75, 1.0)
"""SGLang's prefill jitters each registration delay down by up to 25 %."""


class DirectoryRegistrationFailed(Exception):
    """The directory at `bootstrap_url` did not take a registration."""

    def __init__(self, bootstrap_url: str, last_error: str, *, status: int | None = None) -> None:
        super().__init__(f"registration at {bootstrap_url} failed: {last_error}")
        self.bootstrap_url = bootstrap_url
        self.last_error = last_error
        self.status = status
        """HTTP status of the last answer; None when the last try got no answer."""


async def _put_once(
    client: httpx.AsyncClient, url: str, body: dict[str, object], timeout: float
) -> tuple[int | None, str]:
    """One PUT; returns (status or None, a description of the failure or "OK")."""
    try:
        response = await client.put(url, json=body, timeout=timeout)
    except httpx.HTTPError as exc:
        return None, describe_error(exc)
    if response.status_code == 200:
        return 200, "OK"
    return response.status_code, describe_answer(response)


async def register_rank(
    client: httpx.AsyncClient,
    bootstrap_url: str,
    registration: RankRegistration,
    *,
    attempts: int = 5,
    base_delay: float = 1.0,
    max_delay: float = 30.0,
    timeout: float = 5.0,
    sleep: Sleep = asyncio.sleep,
    rand: Callable[[], float] = random.random,
) -> None:
    """PUT /route until accepted; `DirectoryRegistrationFailed` on a 4xx or out of tries."""
    if attempts < 1:
        raise ValueError("attempts must be at least 1")
    url = f"{bootstrap_url}/route"
    body = registration.model_dump(mode="json")
    backoff = Backoff(base_delay, max_delay, jitter=SGLANG_JITTER)
    last_error = "no attempt made"
    last_status: int | None = None
    for attempt in range(attempts):
        status, last_error = await _put_once(client, url, body, timeout)
        if status == 200:
            log.debug("registered %s at %s", registration.coordinate, bootstrap_url)
            return
        last_status = status
        if status is not None and 400 <= status < 500:
            raise DirectoryRegistrationFailed(bootstrap_url, last_error, status=status)
        log.warning(
            "registration of %s at %s, try %d/%d failed: %s",
            registration.coordinate,
            bootstrap_url,
            attempt + 1,
            attempts,
            last_error,
        )
        if attempt + 1 < attempts:
            await sleep(backoff.delay(attempt, rand()))
    raise DirectoryRegistrationFailed(
        bootstrap_url, f"{last_error} (after {attempts} tries)", status=last_status
    )


async def register_room_dp_rank(
    client: httpx.AsyncClient,
    bootstrap_url: str,
    room: int,
    dp_rank: int,
    *,
    timeout: float = 5.0,
) -> None:
    """Tell the directory which DP rank serves `room`, for decodes that must ask.

    One try, as SGLang's prefill does: the decode keeps polling for the room, and a
    retry here would only race the next request's registration.
    """
    entry = RoomRegistration(bootstrap_room=room, dp_rank=dp_rank)
    try:
        response = await client.post(
            f"{bootstrap_url}/register_dp_rank", json=entry.model_dump(), timeout=timeout
        )
    except httpx.HTTPError as exc:
        raise DirectoryRegistrationFailed(bootstrap_url, describe_error(exc)) from exc
    if response.status_code != 200:
        raise DirectoryRegistrationFailed(
            bootstrap_url, describe_answer(response), status=response.status_code
        )


class KeepAlive:
    """Re-registers a process's ranks every `interval` seconds until stopped.

    Start it once the initial `register_rank` calls succeeded. Each pass sends every
    registration once, concurrently; failures are logged when the directory stops taking
    them and again when it recovers, not at every pass.
    """

    def __init__(
        self,
        client: httpx.AsyncClient,
        bootstrap_url: str,
        registrations: Sequence[RankRegistration],
        *,
        interval: float = 5.0,
        timeout: float = 5.0,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        if interval <= 0:
            raise ValueError("interval must be positive")
        self._client = client
        self._url = bootstrap_url
        self._bodies = [(r, r.model_dump(mode="json")) for r in registrations]
        self._interval = interval
        self._timeout = timeout
        self._sleep = sleep
        self._task: asyncio.Task[None] | None = None
        self._failing = False
        self.passes = 0
        self.failures = 0
        """Registrations not accepted, over all passes."""

    async def tick(self) -> int:
        """One re-registration pass; returns how many registrations were accepted."""
        url = f"{self._url}/route"
        results = await asyncio.gather(
            *(_put_once(self._client, url, body, self._timeout) for _, body in self._bodies)
        )
        self.passes += 1
        errors = [
            f"{reg.coordinate}: {error}"
            for (reg, _), (status, error) in zip(self._bodies, results, strict=True)
            if status != 200
        ]
        self.failures += len(errors)
        if errors and not self._failing:
            log.warning("keep-alive at %s: %s", self._url, "; ".join(errors))
        elif not errors and self._failing:
            log.info("keep-alive at %s: directory accepts registrations again", self._url)
        self._failing = bool(errors)
        return len(self._bodies) - len(errors)

    def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("keep-alive already started")
        self._task = asyncio.create_task(self._run(), name=f"keep-alive {self._url}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        await asyncio.wait([task])
        if not task.cancelled() and (error := task.exception()) is not None:
            raise error

    async def _run(self) -> None:
        while True:
            await self._sleep(self._interval)
            await self.tick()
