"""Sending a request to a pair until one answers: attempts, retries, the request deadline.

Each attempt asks the `Chooser` for a pair (avoiding workers that already failed this
request while others remain, of the kind asked for when one is) and hands it to the `Legs`
of the pair's kind: SGLang's two calls at once (`gateway.legs.sglang`), vLLM's one after
the other (`gateway.legs.vllm`); a plan whose decode prefills itself to the local legs
(`gateway.legs.local`). The retry loop follows sglang-router: at most
`max_retries` attempts in all, waiting `RetrySchedule.delay(n)` between them, each with a
new pair. The whole request is bounded by the request deadline (`gateway.legs.deadline`),
answered 504 with the PD stage it stopped in. Cancelling `forward` (the client went away)
cancels the attempt's calls.

The chooser is an interface so that an entry point that chooses differently (a sidecar
whose decode is itself) runs the same legs with the same retries and deadline.

A request whose first attempt ran by callbacks (`gateway.serving.relay`, on
`gateway.legs.relayed`) is carried on here only when that attempt needs more than
callbacks: its failure, to retry, or a plan whose legs are not relayed; `forward` then
takes its `Begun` as attempt 0 and its `Progress`, so the deadline still runs from the
request's start.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Protocol

from gateway.http.answer import Answer, error_body
from gateway.legs.attempt import Attempt, Failure, Legs
from gateway.legs.deadline import DeadlineWatch, Progress
from gateway.legs.retry import RetrySchedule
from gateway.policies.base import NoCandidates
from gateway.requests.query import RouteQuery
from gateway.requests.request import Request
from gateway.routing.plan import RoutePlan
from gateway.settings.base import Kind
from gateway.telemetry.metrics import GatewayMetrics
from kvplumbing.clock import Sleep

log = logging.getLogger(__name__)


class Chooser(Protocol):
    """Chooses a pair for one attempt (`gateway.routing.router.Router`)."""

    def plan(self, query: RouteQuery, avoid: Collection[str] = ()) -> RoutePlan:
        """A pair for `query`, avoiding the workers in `avoid` (those that failed this
        request) while others remain; raises `NoCandidates` naming the role without an
        eligible worker."""
        ...


@dataclass(slots=True)
class Begun:
    """A first attempt begun outside `forward`: its plan, chosen but not run, or the
    failure it ended in."""

    plan: RoutePlan | None = None
    failure: Failure | None = None


class Dispatcher:
    def __init__(
        self,
        chooser: Chooser,
        legs: Mapping[Kind, Legs],
        retries: RetrySchedule,
        metrics: GatewayMetrics,
        *,
        timeout: float,
        sleep: Sleep = asyncio.sleep,
        local: Legs | None = None,
    ) -> None:
        """`local`: the legs of a plan whose decode prefills itself (`RoutePlan.local`)."""
        self._chooser = chooser
        self._legs = legs
        self._local = local
        self._retries = retries
        self._metrics = metrics
        self._sleep = sleep
        self.deadlines = DeadlineWatch(timeout)

    async def forward(
        self, request: Request, progress: Progress | None = None, first: Begun | None = None
    ) -> Answer:
        """The answer within the request deadline, or a 504 saying where it stopped.
        `progress` and `first`: the request's deadline and first attempt, when they were
        begun outside (`Begun`)."""
        deadlines = self.deadlines
        if progress is None:
            progress = deadlines.start()
        else:
            deadlines.take_over(progress)
        try:
            outcome = await self._forward(request, progress, first)
        except asyncio.CancelledError:
            if not deadlines.finish(progress):
                raise
            return self.timed_out(request, progress)
        except BaseException:
            deadlines.finish(progress)
            raise
        deadlines.finish(progress)
        return outcome

    def timed_out(self, request: Request, progress: Progress) -> Answer:
        """The 504 of a request whose deadline passed, counted and logged."""
        endpoint, stage = request.parsed.endpoint, progress.stage
        self._metrics.request_timeouts.labels(endpoint, stage).inc()
        log.warning("%s: %s", endpoint, progress.message(self.deadlines.timeout))
        return progress.answer(self.deadlines.timeout)

    def first_plan(self, request: Request) -> RoutePlan | Answer:
        """The first attempt's pair, or the 503 when there is none."""
        return self._plan(request, (), 0)

    def _plan(self, request: Request, avoid: Collection[str], number: int) -> RoutePlan | Answer:
        """Attempt `number`'s pair (0 for the first), avoiding the workers in `avoid`; the
        503 naming the role without a worker when there is none."""
        try:
            plan = self._chooser.plan(request.query, avoid)
        except NoCandidates as exc:
            return Answer(503, error_body(str(exc), "no_available_workers"))
        if log.isEnabledFor(logging.DEBUG):
            _log_plan(request, plan, number)
        return plan

    def legs(self, plan: RoutePlan) -> Legs:
        """The legs that run `plan`."""
        return self._local if plan.local and self._local else self._legs[plan.prefill.kind]

    def retries(self, failure: Failure) -> bool:
        """A first attempt's `failure` is followed by another attempt."""
        return failure.retryable and self._retries.max_attempts > 1

    async def _forward(self, request: Request, progress: Progress, first: Begun | None) -> Answer:
        avoid: set[str] = set()
        last: Failure | None = None
        attempts = self._retries.max_attempts
        for number in range(attempts):
            if number == 0 and first is not None and first.failure is not None:
                outcome = first.failure
            else:
                if number == 0 and first is not None and first.plan is not None:
                    plan: RoutePlan | Answer = first.plan
                else:
                    plan = self._plan(request, avoid, number)
                if isinstance(plan, Answer):
                    return plan if last is None else last.answer
                attempt = Attempt(number, number + 1 >= attempts, progress)
                answered = await self.legs(plan).run(request, plan, attempt)
                if not isinstance(answered, Failure):
                    return answered
                outcome = answered
            last = outcome
            avoid.add(outcome.worker.id)
            if not outcome.retryable or number + 1 >= attempts:
                break
            self.retrying(request, outcome, number)
            progress.between_attempts = True
            await self._sleep(self._retries.delay(number))
        assert last is not None
        return last.answer

    def retrying(self, request: Request, failure: Failure, attempt: int) -> None:
        """Attempt `attempt` (0 for the first) ended in `failure` and another follows:
        counted by the endpoint and the role that failed."""
        self._metrics.retries.labels(request.parsed.endpoint, failure.role).inc()


def _log_plan(request: Request, plan: RoutePlan, attempt: int) -> None:
    """One line per attempt, so an operator can follow a room to both engines' logs."""
    choice = plan.prefill_choice
    log.debug(
        "%s attempt %d: prefill=%s pod=%s hit_tokens=%d dp_rank=%s decode=%s rooms=%s",
        request.parsed.endpoint,
        attempt + 1,
        plan.prefill.id,
        plan.prefill.pod,
        choice.hit_tokens,
        choice.dp_rank,
        plan.decode.id,
        ",".join(str(room) for room in plan.rooms),
    )
