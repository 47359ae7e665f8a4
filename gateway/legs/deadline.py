"""The request deadline: how long the gateway tries before it answers 504, and where it was.

`--request-timeout-secs` (sglang-router's flag and default, 1800 s) bounds a request from
the dispatcher's first attempt until its answer: a whole answer in full, a stream until
its first byte (after that only each silence is bounded, by the same value, as before).
All attempts and the waits between them count. sglang-router gives the value to its HTTP
client as a total timeout per upstream call, which also cuts a stream that runs longer;
here a stream that keeps flowing is not cut.

A request that runs out is answered 504 with the PD stage it stopped in, judged from what
the gateway saw of its last attempt:

- `prefill`: neither side had answered (the two engines still handshaking or computing);
- `decode`: the prefill had answered, the decode not — a decode waiting for KV that the
  prefill says it sent;
- `decode_first_byte`: the decode's answer had begun (head) without its first body byte;
- `retry_backoff`: between two attempts.

A request served by callbacks rather than a task (`gateway.serving.relay`) is ended by
its `expire` hook instead of a cancellation, until a task takes it over (a retry).

`DeadlineWatch` keeps one timer for every request in flight rather than one per request
(a timer set and cancelled per request costs CPU on each, `docs/gateway-design.md`).
Every request gets the same timeout, so deadlines expire in arrival order and a queue is
enough.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.http.answer import Answer
from gateway.http.reply import Reply


# Built per request: its own __init__, compiled where the module is (the dataclass gives
# eq and repr only; its generated __init__ runs interpreted): docs/gateway-design.md.
@dataclass(slots=True, init=False)
class Progress:
    """What the gateway knows of a request's current attempt, for the 504 it may give."""

    deadline: float
    task: asyncio.Task[Any] | None
    expire: Callable[[], None] | None
    """Ends the request at its deadline where no task serves it (callbacks do)."""
    attempt: int
    prefill: str
    decode: str
    prefill_call: asyncio.Future[Any] | Reply | None
    decode_head: bool
    """The decode's answer had begun (its head arrived)."""
    between_attempts: bool
    expired: bool
    finished: bool
    _cancelling: int = field(repr=False)

    def __init__(
        self,
        deadline: float,
        task: asyncio.Task[Any] | None,
        expire: Callable[[], None] | None = None,
    ) -> None:
        self.deadline = deadline
        self.task = task
        self.expire = expire
        self.attempt = 0
        self.prefill = ""
        self.decode = ""
        self.prefill_call = None
        self.decode_head = False
        self.between_attempts = False
        self.expired = False
        self.finished = False
        self._cancelling = 0

    def begin(
        self, attempt: int, prefill: str, decode: str, call: asyncio.Future[Any] | Reply
    ) -> None:
        self.attempt = attempt + 1
        self.prefill, self.decode, self.prefill_call = prefill, decode, call
        self.decode_head = False
        self.between_attempts = False

    def prefill_status(self) -> int | None:
        """The prefill's HTTP status once it answered; None before (or on a transport error)."""
        call = self.prefill_call
        if isinstance(call, Reply):
            return call.status if call.done and call.status else None
        if call is None or not call.done() or call.cancelled() or call.exception() is not None:
            return None
        status: int = call.result().status
        return status

    @property
    def stage(self) -> str:
        if self.between_attempts:
            return "retry_backoff"
        if self.decode_head:
            return "decode_first_byte"
        status = self.prefill_status()
        return "decode" if status is not None and status < 300 else "prefill"

    def message(self, timeout: float) -> str:
        status = self.prefill_status()
        said = {
            "prefill": "neither the prefill nor the decode had answered",
            "decode": f"the prefill had answered HTTP {status}, the decode had not answered",
            "decode_first_byte": "the decode's answer had begun without its first byte",
            "retry_backoff": "it was waiting to retry",
        }[self.stage]
        return (
            f"no answer within the request deadline (--request-timeout-secs {timeout:g}): "
            f"{said} (attempt {self.attempt}, prefill {self.prefill}, decode {self.decode})"
        )

    def answer(self, timeout: float) -> Answer:
        status = self.prefill_status()
        error = {
            "message": self.message(timeout),
            "type": "request_timeout",
            "param": None,
            "code": None,
            "stage": self.stage,
            "attempt": self.attempt,
            "timeout_secs": timeout,
            "prefill": {"worker": self.prefill, "answered": status},
            "decode": {"worker": self.decode, "answer_begun": self.decode_head},
        }
        return Answer(504, json.dumps({"error": error}).encode())


class DeadlineWatch:
    """Cancels the task of a request whose deadline passed, marking its `Progress` expired."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: deque[Progress] = deque()
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> Progress:
        """A request begins in the current task; call `expired(progress)` when it ends."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        progress = Progress(loop.time() + self.timeout, task)
        if task is not None:
            progress._cancelling = task.cancelling()
        self._queue.append(progress)
        if self._timer is None:
            self._timer = loop.call_at(progress.deadline, self._expire)
        return progress

    def start_by(self, expire: Callable[[], None]) -> Progress:
        """A request served by callbacks begins: `expire` ends it at its deadline, unless
        a task takes it over first (`Progress.task`, set by `take_over`)."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        progress = Progress(loop.time() + self.timeout, None, expire)
        self._queue.append(progress)
        if self._timer is None:
            self._timer = loop.call_at(progress.deadline, self._expire)
        return progress

    @staticmethod
    def take_over(progress: Progress) -> None:
        """The current task serves `progress`'s request from now on: cancelled at its
        deadline, as `start` would have it."""
        task = asyncio.current_task()
        progress.task, progress.expire = task, None
        if task is not None:
            progress._cancelling = task.cancelling()

    def finish(self, progress: Progress) -> bool:
        """The request ended; True when it ended because its deadline passed (its task's
        cancellation is then taken back, unless someone else also cancelled it).

        Its `expire` is dropped: it is the request's own (a bound method of whoever serves
        it by callbacks, which holds `progress`), a cycle only the garbage collector would
        free otherwise, with everything the request holds."""
        progress.finished = True
        progress.expire = None
        queue = self._queue
        while queue and queue[0].finished:
            queue.popleft()
        if not progress.expired or progress.task is None:
            return False
        return progress.task.uncancel() <= progress._cancelling

    def _expire(self) -> None:
        assert self._loop is not None
        self._timer = None
        now = self._loop.time()
        queue = self._queue
        while queue and (queue[0].finished or queue[0].deadline <= now):
            _end(queue.popleft())
        if queue:
            self._timer = self._loop.call_at(queue[0].deadline, self._expire)

    def expire_all(self) -> None:
        """Every request in flight runs out now, as if its deadline had passed (tests
        drive the deadline with it instead of waiting for the clock)."""
        queue, self._queue = self._queue, deque()
        for progress in queue:
            _end(progress)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._queue.clear()


def _end(progress: Progress) -> None:
    """`progress`'s request ran out: its task cancelled, or its `expire` called."""
    if progress.finished:
        return
    if progress.task is not None:
        progress.expired = True
        progress.task.cancel()
    elif progress.expire is not None:
        progress.expired = True
        progress.expire()
