"""Sending a request to its pair: both at once, the decode's answer back, retries.

One attempt (`_attempt`): the same bound body is POSTed to the prefill and the decode
concurrently through the one pooled client. The client gets the decode's answer; for a
stream, chunks are passed on as they arrive (`aiter_raw`, no buffering). Until the
decode's first body byte exists nothing is committed to the client, so:
- a prefill failure (transport error or 5xx/408/429) in that window cancels the decode
  and the attempt is retried with a new pair and new rooms;
- a prefill 4xx is the client's fault: the decode is cancelled and that answer returned;
- a decode transport error or retryable status is retried the same way.
After the first byte, a failure can only end the stream.

The retry loop (`forward`) follows sglang-router: at most `max_retries` attempts in all,
waiting `Backoff.delay(n)` between them, each with a new pair (workers that failed this
request are avoided while others remain). Every finished upstream call is recorded in
its worker's circuit breaker; calls cancelled by the gateway are not. Cancelling
`forward` (the client went away) cancels both upstream calls.

Load bookkeeping for the policies: the prefill's queued tokens are released when its
call ends, each side's in-flight count when its call ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from gateway.breaker import is_failure_status
from gateway.inject import inject_bootstrap
from gateway.metrics import GatewayMetrics
from gateway.policies.base import LoadTicket, NoCandidates, RouteRequest
from gateway.requests import ParsedRequest
from gateway.retry import Backoff, is_retryable_status
from gateway.router import RoutePlan, Router
from gateway.workers import Worker

log = logging.getLogger(__name__)
Sleep = Callable[[float], Awaitable[None]]
_UPSTREAM_HEADERS = {"content-type": "application/json", "accept-encoding": "identity"}
_PASSED_HEADERS = ("content-type", "cache-control", "x-request-id")


def error_body(message: str, kind: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind}}).encode()


@dataclass(slots=True)
class Answer:
    """A complete answer for the client."""

    status: int
    body: bytes
    media_type: str = "application/json"


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


@dataclass(slots=True)
class _Failure:
    role: str
    worker: Worker
    retryable: bool
    answer: Answer


@dataclass(slots=True)
class _PrefillCall:
    task: asyncio.Task[Answer | None]

    @property
    def failed(self) -> bool:
        """Ended without a successful answer (transport error or status >= 400)."""
        if not self.task.done() or self.task.cancelled():
            return False
        answer = self.task.result()
        return answer is None or answer.status >= 400


class Dispatcher:
    def __init__(
        self,
        client: httpx.AsyncClient,
        router: Router,
        backoff: Backoff,
        metrics: GatewayMetrics,
        *,
        timeout: float,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self._client = client
        self._router = router
        self._backoff = backoff
        self._metrics = metrics
        self._timeout = timeout
        self._sleep = sleep
        self._background: set[asyncio.Task[Answer | None]] = set()

    async def drain(self) -> None:
        """Wait for prefill calls that outlived their request (tests, shutdown)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    async def forward(
        self, request: ParsedRequest, route: RouteRequest, path: str
    ) -> Answer | Stream:
        avoid: set[str] = set()
        last: _Failure | None = None
        attempts = self._backoff.max_attempts
        for attempt in range(attempts):
            try:
                plan = self._router.plan(route, request.batch, avoid)
            except NoCandidates as exc:
                if last is not None:
                    return last.answer
                return Answer(503, error_body(str(exc), "no_available_workers"))
            if log.isEnabledFor(logging.DEBUG):
                _log_plan(request, plan, attempt)
            outcome = await self._attempt(request, plan, path)
            if not isinstance(outcome, _Failure):
                return outcome
            last = outcome
            avoid.add(outcome.worker.id)
            if not outcome.retryable or attempt + 1 >= attempts:
                break
            self._metrics.retries.labels(request.endpoint, outcome.role).inc()
            await self._sleep(self._backoff.delay(attempt))
        assert last is not None
        return last.answer

    def _record(self, role: str, worker: Worker, status: int | None, error: str | None) -> None:
        failed = status is None or is_failure_status(status)
        worker.breaker.record(not failed)
        if failed:
            self._metrics.upstream_failures.labels(role, error or str(status)).inc()

    async def _call_prefill(self, worker: Worker, path: str, payload: bytes) -> Answer | None:
        """The prefill's answer, or None when it failed in transport."""
        try:
            response = await self._client.post(
                worker.url + path, content=payload, headers=_UPSTREAM_HEADERS, timeout=self._timeout
            )
        except httpx.HTTPError as exc:
            self._record("prefill", worker, None, type(exc).__name__)
            return None
        self._record("prefill", worker, response.status_code, None)
        return Answer(response.status_code, response.content, _media(response))

    def _start_prefill(self, plan: RoutePlan, path: str, payload: bytes) -> _PrefillCall:
        loads = self._router.loads
        ticket = loads.start(plan.prefill.id, plan.prefill_choice.uncached_tokens)
        task = asyncio.create_task(self._call_prefill(plan.prefill, path, payload))
        self._background.add(task)

        def ended(_: asyncio.Task[Answer | None]) -> None:
            loads.finish(ticket)
            self._background.discard(task)

        task.add_done_callback(ended)
        return _PrefillCall(task)

    @staticmethod
    async def _race(step: asyncio.Task[Any], call: _PrefillCall) -> bool:
        """Wait for `step` unless the prefill fails first; True when `step` finished."""
        if not call.task.done():
            await asyncio.wait({step, call.task}, return_when=asyncio.FIRST_COMPLETED)
        if step.done():
            return True
        if call.failed:
            return False
        await asyncio.wait({step})
        return True

    @staticmethod
    def _prefill_failure(plan: RoutePlan, call: _PrefillCall) -> _Failure:
        answer = call.task.result()
        if answer is None:
            message = f"prefill {plan.prefill.id} unreachable"
            return _Failure(
                "prefill", plan.prefill, True, Answer(502, error_body(message, "upstream_error"))
            )
        return _Failure("prefill", plan.prefill, is_retryable_status(answer.status), answer)

    def _decode_error(self, decode: Worker, exc: httpx.HTTPError, when: str) -> _Failure:
        self._record("decode", decode, None, type(exc).__name__)
        message = f"decode {decode.id} failed {when}: {type(exc).__name__}"
        return _Failure("decode", decode, True, Answer(502, error_body(message, "upstream_error")))

    async def _attempt(
        self, request: ParsedRequest, plan: RoutePlan, path: str
    ) -> Answer | Stream | _Failure:
        prefill, decode = plan.prefill, plan.decode
        body = inject_bootstrap(
            request.body,
            request.endpoint,
            host=prefill.host,
            port=prefill.bootstrap_port,
            rooms=plan.rooms,
        )
        payload = json.dumps(body).encode()
        call = self._start_prefill(plan, path, payload)
        loads = self._router.loads
        decode_ticket = loads.start(decode.id)
        upstream = self._client.build_request(
            "POST",
            decode.url + path,
            content=payload,
            headers=_UPSTREAM_HEADERS,
            timeout=self._timeout,
        )
        send = asyncio.create_task(self._client.send(upstream, stream=True))
        step: asyncio.Task[Any] = send
        response: httpx.Response | None = None
        succeeded = committed = False
        try:
            if not await self._race(send, call):
                return self._prefill_failure(plan, call)
            try:
                response = send.result()
            except httpx.HTTPError as exc:
                return self._decode_error(decode, exc, "to answer")
            status = response.status_code
            if status >= 400:
                content = await response.aread()
                self._record("decode", decode, status, None)
                if call.failed and not self._prefill_failure(plan, call).retryable:
                    return self._prefill_failure(plan, call)
                answer = Answer(status, content, _media(response))
                return _Failure("decode", decode, is_retryable_status(status), answer)
            if not request.stream:
                step = asyncio.create_task(response.aread())
                if not await self._race(step, call):
                    return self._prefill_failure(plan, call)
                try:
                    content = step.result()
                except httpx.HTTPError as exc:
                    return self._decode_error(decode, exc, "mid-answer")
                self._record("decode", decode, status, None)
                succeeded = True
                return Answer(status, content, _media(response))
            chunks = response.aiter_raw()
            step = asyncio.create_task(_next_chunk(chunks))
            if not await self._race(step, call):
                return self._prefill_failure(plan, call)
            try:
                head = step.result()
            except httpx.HTTPError as exc:
                return self._decode_error(decode, exc, "before its first byte")
            succeeded = committed = True
            closer = self._closer(response, decode, decode_ticket, call)
            return Stream(status, _passed_headers(response), head, chunks, closer)
        finally:
            if not committed:
                step.cancel()
                send.cancel()
                await asyncio.wait({step, send})
                if response is None and not send.cancelled() and send.exception() is None:
                    response = send.result()
                if response is not None:
                    await response.aclose()
                loads.finish(decode_ticket)
            if not succeeded:
                call.task.cancel()

    def _closer(
        self, response: httpx.Response, decode: Worker, ticket: LoadTicket, call: _PrefillCall
    ) -> Callable[[str], Awaitable[None]]:
        async def close(outcome: str) -> None:
            await response.aclose()
            self._router.loads.finish(ticket)
            if outcome == "client_gone":
                call.task.cancel()
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


async def _next_chunk(chunks: AsyncIterator[bytes]) -> bytes:
    """The first non-empty chunk (an empty stream yields b"")."""
    async for chunk in chunks:
        if chunk:
            return chunk
    return b""


def _media(response: httpx.Response) -> str:
    return str(response.headers.get("content-type", "application/json"))


def _passed_headers(response: httpx.Response) -> dict[str, str]:
    return {k: response.headers[k] for k in _PASSED_HEADERS if k in response.headers}
