"""Sending a request to its pair: both at once, the decode's answer back, retries.

A pair of vLLM workers is sent its legs one after the other instead
(`gateway.legs.vllm`), through the same prefill call, decode legs, retries, breakers
and deadline as below. One SGLang attempt: the same bound body is POSTed to the prefill and
the decode concurrently through the `gateway.http.upstream.Upstream` (the gateway's connection
pool in production, httpx in tests). The client gets the decode's answer; for a stream,
pieces are passed on as they arrive (no buffering). Until the decode's first body byte
exists nothing is committed to the client, so:
- a prefill failure (transport error or 5xx/408/429) in that window cancels the decode
  and the attempt is retried with a new pair and new rooms;
- a prefill 4xx is the client's fault: the decode is cancelled and that answer returned;
- a decode transport error or retryable status is retried the same way.
After the first byte, a failure can only end the stream.

The retry loop (`forward`) follows sglang-router: at most `max_retries` attempts in all,
waiting `RetrySchedule.delay(n)` between them, each with a new pair (workers that failed this
request are avoided while others remain). Every finished upstream call is recorded in
its worker's circuit breaker; calls cancelled by the gateway are not. Cancelling
`forward` (the client went away) cancels both upstream calls.

The calls are futures raced through done-callbacks (`gateway.legs.racing`), not tasks: with
the connection pool, an attempt costs the task of the request that awaits it and nothing
more. The whole request is bounded by the request deadline (`gateway.legs.deadline`).

Load bookkeeping for the policies: the prefill's queued tokens are released when its
call ends, each side's in-flight count when its call ends. A failed call is also noted as
its worker's last error (`/workers`, `globalkv doctor`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx

from gateway.config import Kind
from gateway.http.answer import Answer, error_body
from gateway.http.upstream import Extra, Reply, Upstream
from gateway.legs.deadline import DeadlineWatch, Progress
from gateway.legs.racing import Call, failed, race, settle
from gateway.legs.retry import RetrySchedule, is_retryable_status
from gateway.legs.sglang import inject_bootstrap
from gateway.legs.vllm import Failure, Sequential
from gateway.metrics import GatewayMetrics
from gateway.policies.base import LoadTicket, NoCandidates, RouteRequest
from gateway.requests import ParsedRequest, encode_body
from gateway.routing.router import RoutePlan, Router
from gateway.workers.breaker import is_failure_status
from gateway.workers.pool import Worker
from kvplumbing.clock import Clock, Sleep

log = logging.getLogger(__name__)
_PASSED_HEADERS = ("content-type", "cache-control", "x-request-id")
_JSON = b"application/json"

__all__ = ["Answer", "Dispatcher", "Stream", "error_body"]


@dataclass(slots=True)
class Stream:
    """A committed stream: `first` is already read; `close` must be awaited at the end."""

    status: int
    headers: dict[str, str]
    first: bytes
    rest: AsyncIterator[bytes]
    close: Callable[[str], Awaitable[None]]
    """close(outcome): "done", "upstream_error" (recorded on the decode's breaker) or
    "client_gone" (cancels a prefill still running, records nothing)."""


class Dispatcher:
    def __init__(
        self,
        upstream: Upstream,
        router: Router,
        retries: RetrySchedule,
        metrics: GatewayMetrics,
        *,
        timeout: float,
        clock: Clock,
        sleep: Sleep = asyncio.sleep,
        vllm_allow_recompute: bool = False,
    ) -> None:
        self._upstream = upstream
        self._router = router
        self._retries = retries
        self._metrics = metrics
        self._timeout = timeout
        self._clock = clock
        self._sleep = sleep
        self._background: set[Call] = set()
        self.deadlines = DeadlineWatch(timeout)
        self._sequential = Sequential(self, metrics, allow_recompute=vllm_allow_recompute)

    async def drain(self, timeout: float | None = None) -> None:
        """Wait for prefill calls that outlived their request (tests, shutdown); those
        still running after `timeout` seconds are cancelled."""
        if self._background and timeout is not None:
            await asyncio.wait(list(self._background), timeout=timeout)
            for call in list(self._background):
                call.cancel()
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    async def forward(
        self, request: ParsedRequest, route: RouteRequest, path: str
    ) -> Answer | Stream:
        """The answer within the request deadline, or a 504 saying where it stopped."""
        deadlines = self.deadlines
        progress = deadlines.start()
        try:
            outcome = await self._forward(request, route, path, progress)
        except asyncio.CancelledError:
            if not deadlines.finish(progress):
                raise
            stage = progress.stage
            self._metrics.request_timeouts.labels(request.endpoint, stage).inc()
            log.warning("%s: %s", request.endpoint, progress.message(deadlines.timeout))
            return progress.answer(deadlines.timeout)
        except BaseException:
            deadlines.finish(progress)
            raise
        deadlines.finish(progress)
        return outcome

    async def _forward(
        self, request: ParsedRequest, route: RouteRequest, path: str, progress: Progress
    ) -> Answer | Stream:
        avoid: set[str] = set()
        last: Failure | None = None
        attempts = self._retries.max_attempts
        kind: Kind | None = "sglang" if request.endpoint == "generate" else None
        for attempt in range(attempts):
            try:
                plan = self._router.plan(route, request.batch, avoid, request.model, kind)
            except NoCandidates as exc:
                if last is not None:
                    return last.answer
                return Answer(503, error_body(str(exc), "no_available_workers"))
            if log.isEnabledFor(logging.DEBUG):
                _log_plan(request, plan, attempt)
            if plan.prefill.kind == "vllm":
                final = attempt + 1 >= attempts
                outcome = await self._sequential.attempt(
                    request, plan, path, attempt, progress, final=final
                )
            else:
                outcome = await self._attempt(request, plan, path, attempt, progress)
            if not isinstance(outcome, Failure):
                return outcome
            last = outcome
            avoid.add(outcome.worker.id)
            if not outcome.retryable or attempt + 1 >= attempts:
                break
            self._metrics.retries.labels(request.endpoint, outcome.role).inc()
            progress.between_attempts = True
            await self._sleep(self._retries.delay(attempt))
        assert last is not None
        return last.answer

    def _record(
        self, role: str, worker: Worker, status: int | None, error: BaseException | str | None
    ) -> None:
        """One finished call in the worker's breaker; a failure (a transport error, a
        stream broken off, or a failure status) counted and noted as its last error."""
        failed = status is None or is_failure_status(status)
        worker.breaker.record(not failed)
        if not failed:
            return
        if isinstance(error, BaseException):
            reason, detail = type(error).__name__, f"{type(error).__name__}: {error}"
        else:
            reason = detail = error or str(status)
        self._metrics.upstream_failures.labels(role, reason).inc()
        what = f"answered HTTP {status}" if status is not None else f"failed ({detail})"
        worker.note_error(f"{role} call {what}", self._clock())

    def start_prefill(self, plan: RoutePlan, path: str, payload: bytes, extra: Extra = ()) -> Call:
        """The prefill's call, its load and breaker bookkeeping attached."""
        choice = plan.prefill_choice
        ticket = self._router.loads.start(
            plan.prefill.id,
            choice.uncached_tokens,
            plan.keys,
            plan.dp_rank,
            cached_tokens=choice.hit_tokens,
        )
        call = asyncio.ensure_future(
            self._upstream.fetch(plan.prefill.url + path, payload, self._timeout, extra)
        )
        self._background.add(call)
        call.add_done_callback(partial(self._prefill_ended, plan.prefill, ticket))
        return call

    def _prefill_ended(self, worker: Worker, ticket: LoadTicket, call: Call) -> None:
        computed = not call.cancelled() and call.exception() is None and call.result().status < 300
        self._router.loads.finish(ticket, computed)
        self._background.discard(call)
        if call.cancelled():
            return
        error = call.exception()
        if error is None:
            self._record("prefill", worker, call.result().status, None)
            return
        if not isinstance(error, httpx.HTTPError):
            log.error("the call to prefill %s failed unexpectedly", worker.id, exc_info=error)
        self._record("prefill", worker, None, error)

    def decode_ticket(self, plan: RoutePlan) -> LoadTicket:
        """The decode's in-flight count, released when its call ends."""
        return self._router.loads.start(plan.decode.id)

    @staticmethod
    def prefill_failure(plan: RoutePlan, call: Call) -> Failure:
        """What a failed prefill call answers the client, and whether to retry."""
        if call.exception() is not None:
            message = f"prefill {plan.prefill.id} unreachable"
            return Failure(
                "prefill", plan.prefill, True, Answer(502, error_body(message, "upstream_error"))
            )
        answer = call.result()
        return Failure(
            "prefill",
            plan.prefill,
            is_retryable_status(answer.status),
            Answer(answer.status, answer.body, answer.media_type),
        )

    def _decode_error(self, decode: Worker, exc: httpx.HTTPError, when: str) -> Failure:
        self._record("decode", decode, None, exc)
        message = f"decode {decode.id} failed {when}: {type(exc).__name__}"
        return Failure("decode", decode, True, Answer(502, error_body(message, "upstream_error")))

    def _decode_refused(self, plan: RoutePlan, call: Call, answer: Answer) -> Failure:
        """A decode status >= 400; a prefill that failed for good takes precedence."""
        self._record("decode", plan.decode, answer.status, None)
        if failed(call):
            failure = self.prefill_failure(plan, call)
            if not failure.retryable:
                return failure
        return Failure("decode", plan.decode, is_retryable_status(answer.status), answer)

    async def _attempt(
        self,
        request: ParsedRequest,
        plan: RoutePlan,
        path: str,
        attempt: int,
        progress: Progress,
    ) -> Answer | Stream | Failure:
        prefill = plan.prefill
        body = inject_bootstrap(
            request.body,
            request.endpoint,
            host=prefill.host,
            port=prefill.bootstrap_port,
            rooms=plan.rooms,
        )
        payload = encode_body(body)
        call = self.start_prefill(plan, path, payload)
        progress.begin(attempt, prefill.id, plan.decode.id, call)
        ticket = self.decode_ticket(plan)
        url = plan.decode.url + path
        if request.stream:
            return await self.streamed(plan, call, ticket, url, payload, progress)
        return await self.whole(plan, call, ticket, url, payload)

    async def whole(
        self,
        plan: RoutePlan,
        call: Call,
        ticket: LoadTicket,
        url: str,
        payload: bytes,
        extra: Extra = (),
    ) -> Answer | Failure:
        """The decode's whole answer, unless the prefill `call` fails first."""
        step = asyncio.ensure_future(self._upstream.fetch(url, payload, self._timeout, extra))
        succeeded = False
        try:
            if not await race(step, call):
                return self.prefill_failure(plan, call)
            try:
                whole = step.result()
            except httpx.HTTPError as exc:
                return self._decode_error(plan.decode, exc, "to answer")
            answer = Answer(whole.status, whole.body, whole.media_type)
            if answer.status >= 400:
                return self._decode_refused(plan, call, answer)
            self._record("decode", plan.decode, answer.status, None)
            succeeded = True
            return answer
        finally:
            self._router.loads.finish(ticket)
            if not step.done():
                step.cancel()
                await settle(step)
            if not succeeded:
                call.cancel()

    async def streamed(
        self,
        plan: RoutePlan,
        call: Call,
        ticket: LoadTicket,
        url: str,
        payload: bytes,
        progress: Progress,
        extra: Extra = (),
    ) -> Stream | Failure:
        """The decode's stream up to its first byte, unless the prefill `call` fails first."""
        opening = asyncio.ensure_future(self._upstream.open(url, payload, self._timeout, extra))
        step: asyncio.Future[Any] = opening
        reply: Reply | None = None
        committed = False
        try:
            if not await race(opening, call):
                return self.prefill_failure(plan, call)
            try:
                reply = opening.result()
            except httpx.HTTPError as exc:
                return self._decode_error(plan.decode, exc, "to answer")
            if reply.status >= 400:
                try:
                    content = await reply.read()
                except httpx.HTTPError as exc:
                    return self._decode_error(plan.decode, exc, "mid-answer")
                media = reply.header(b"content-type") or _JSON
                return self._decode_refused(plan, call, Answer(reply.status, content, media))
            progress.decode_head = True
            step = asyncio.ensure_future(reply.next())
            if not await race(step, call):
                return self.prefill_failure(plan, call)
            try:
                first = step.result()
            except httpx.HTTPError as exc:
                return self._decode_error(plan.decode, exc, "before its first byte")
            committed = True
            closer = self._closer(reply, plan.decode, ticket, call)
            return Stream(reply.status, _passed_headers(reply), first, _rest(reply), closer)
        finally:
            if not committed:
                step.cancel()
                opening.cancel()
                await settle(step, opening)
                if reply is None and opening.done() and not opening.cancelled():
                    reply = None if opening.exception() else opening.result()
                if reply is not None:
                    await reply.aclose()
                self._router.loads.finish(ticket)
                call.cancel()

    def _closer(
        self, reply: Reply, decode: Worker, ticket: LoadTicket, call: Call
    ) -> Callable[[str], Awaitable[None]]:
        async def close(outcome: str) -> None:
            await reply.aclose()
            self._router.loads.finish(ticket)
            if outcome == "client_gone":
                call.cancel()
            else:
                self._record("decode", decode, 200 if outcome == "done" else None, outcome)

        return close


def _log_plan(request: ParsedRequest, plan: RoutePlan, attempt: int) -> None:
    """One line per attempt, so an operator can follow a room to both engines' logs."""
    choice = plan.prefill_choice
    log.debug(
        "%s attempt %d: prefill=%s pod=%s hit_tokens=%d dp_rank=%s decode=%s rooms=%s",
        request.endpoint,
        attempt + 1,
        plan.prefill.id,
        plan.prefill.pod,
        choice.hit_tokens,
        choice.dp_rank,
        plan.decode.id,
        ",".join(str(room) for room in plan.rooms),
    )


async def _rest(reply: Reply) -> AsyncIterator[bytes]:
    while piece := await reply.next():
        yield piece


def _passed_headers(reply: Reply) -> dict[str, str]:
    found = ((name, reply.header(name.encode())) for name in _PASSED_HEADERS)
    return {name: value.decode("latin-1") for name, value in found if value is not None}
