"""One attempt on a chosen pair: what the dispatcher hands a PD protocol's legs, and how
an attempt that produced no answer ends.

`Legs` is the one interface the dispatcher calls, whatever the pair speaks (SGLang's two
calls at once, `gateway.legs.sglang`; vLLM's one after the other, `gateway.legs.vllm`), so
retrying, the deadline and choosing the next pair stay in one place and the legs never
call back into it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from gateway.http.answer import Answer
from gateway.legs.deadline import Progress
from gateway.requests.request import Request
from gateway.routing.plan import RoutePlan
from gateway.settings.base import Role
from gateway.workers.pool import Worker


@dataclass(slots=True)
class Attempt:
    number: int
    """0 for the first attempt."""
    final: bool
    """No other attempt follows, whatever this one's failure."""
    progress: Progress
    """Where the request is, for the 504 of its deadline; the legs `begin` it."""


@dataclass(slots=True)
class Failure:
    """An attempt that ended without an answer to pass on; `answer` is the client's if no
    other attempt does better."""

    role: Role
    worker: Worker
    retryable: bool
    answer: Answer


class Legs(Protocol):
    """A PD protocol's calls for one attempt on a chosen pair."""

    async def run(self, request: Request, plan: RoutePlan, attempt: Attempt) -> Answer | Failure:
        """The client's answer (whole, or a stream from its first piece on) or the
        attempt's failure; a worker's failure is never raised. Cancelling it cancels its
        calls."""
        ...
