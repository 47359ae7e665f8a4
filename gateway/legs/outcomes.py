"""What an attempt's calls come to: each finished call recorded, each failure judged.

Both ways of running an attempt — as coroutines (`gateway.legs.calls.PairCalls`, which
builds on this) and by callbacks (`gateway.legs.relayed`) — end their calls here, so that
they record and judge them alike: a finished call in its worker's circuit breaker (a call
cancelled by the gateway is not), its load ended, a failure counted and noted as the
worker's last error (`/workers`, `globalkv doctor`); the first of a run of failures is
logged at once (a dead prefill otherwise showed in the log only when its health checks or
its circuit gave up on it, tens of seconds later), the rest by the circuit's transitions,
and a worker answering again after failures is logged too. A failure becomes the
attempt's `Failure`: what the client is answered if no other attempt does better, and
whether another attempt may.
"""

from __future__ import annotations

import logging

import httpx

from gateway.http.answer import Answer, error_body
from gateway.http.connections import LocalResourceError
from gateway.http.reply import Reply
from gateway.legs.attempt import Failure
from gateway.legs.retry import is_retryable_status
from gateway.load.tracker import LoadTicket, LoadTracker
from gateway.routing.plan import RoutePlan
from gateway.settings.base import Role
from gateway.telemetry.metrics import GatewayMetrics
from gateway.workers.breaker import is_failure_status
from gateway.workers.pool import Worker
from kvplumbing.clock import Clock

log = logging.getLogger(__name__)
_PASSED_HEADERS = (b"cache-control", b"x-request-id")


class CallOutcomes:
    def __init__(self, loads: LoadTracker, metrics: GatewayMetrics, clock: Clock) -> None:
        self.loads = loads
        self._metrics = metrics
        self._clock = clock

    def record(
        self, role: Role, worker: Worker, status: int | None, error: BaseException | str | None
    ) -> None:
        """One finished call in the worker's breaker; a failure (a transport error, a
        stream broken off, or a failure status) counted and noted as its last error. A
        call this gateway could not make for want of its own resources is not the worker's
        doing and is held against nothing of it (`_local_failure` answers it)."""
        if isinstance(error, LocalResourceError):
            return
        failure = status is None or is_failure_status(status)
        if not failure:
            failed_before = worker.breaker.failures
            worker.breaker.record(True)
            if failed_before:
                log.info(
                    "%s %s answers again after %d failed calls", role, worker.id, failed_before
                )
            return
        if isinstance(error, BaseException):
            reason, detail = type(error).__name__, f"{type(error).__name__}: {error}"
        else:
            reason = detail = error or str(status)
        self._metrics.upstream_failures.labels(role, reason).inc()
        what = f"answered HTTP {status}" if status is not None else f"failed ({detail})"
        worker.breaker.record(False, what)
        if worker.breaker.failures == 1:
            log.warning("%s %s: a call %s", role, worker.id, what)
        worker.note_error(f"{role} call {what}", self._clock())

    def prefill_ended(
        self, worker: Worker, ticket: LoadTicket, reply: Reply | None, error: BaseException | None
    ) -> None:
        """A prefill call ended, in `error` or else with `reply`: its load finished (its
        prompt computed where it succeeded), the outcome recorded in its breaker."""
        self.loads.finish(ticket, error is None and reply is not None and reply.status < 300)
        if error is None and reply is not None:
            self.record("prefill", worker, reply.status, None)
            return
        if not isinstance(error, httpx.HTTPError):
            log.error("the call to prefill %s failed unexpectedly", worker.id, exc_info=error)
        self.record("prefill", worker, None, error)

    @staticmethod
    def prefill_failed(
        plan: RoutePlan, reply: Reply | None, error: BaseException | None
    ) -> Failure:
        """`prefill_failure` of a call that ended in `error`, else in `reply`."""
        if isinstance(error, LocalResourceError):
            return _local_failure("prefill", plan.prefill, error)
        if error is not None or reply is None:
            message = f"prefill {plan.prefill.id} unreachable"
            return Failure(
                "prefill", plan.prefill, True, Answer(502, error_body(message, "upstream_error"))
            )
        return Failure(
            "prefill",
            plan.prefill,
            is_retryable_status(reply.status),
            Answer(reply.status, reply.body, reply.media_type),
        )

    def decode_error(self, decode: Worker, exc: BaseException, when: str) -> Failure:
        """The attempt's failure when its decode's call failed (`when`: doing what)."""
        if isinstance(exc, LocalResourceError):
            return _local_failure("decode", decode, exc)
        self.record("decode", decode, None, exc)
        message = f"decode {decode.id} failed {when}: {type(exc).__name__}"
        return Failure("decode", decode, True, Answer(502, error_body(message, "upstream_error")))

    def decode_refused(self, plan: RoutePlan, answer: Answer, prefill: Failure | None) -> Failure:
        """A decode status >= 400; `prefill`, the prefill's failure where it failed,
        takes precedence when it is for good."""
        self.record("decode", plan.decode, answer.status, None)
        if prefill is not None and not prefill.retryable:
            return prefill
        return Failure("decode", plan.decode, is_retryable_status(answer.status), answer)

    def decoded(self, plan: RoutePlan, reply: Reply, prefill: Failure | None) -> Answer | Failure:
        """The decode's whole answer, or its refusal (`prefill`'s, the prefill's failure
        where it failed for good)."""
        answer = Answer(reply.status, reply.body, reply.media_type)
        if answer.status >= 400:
            return self.decode_refused(plan, answer, prefill)
        self.record("decode", plan.decode, answer.status, None)
        return answer


def _local_failure(role: Role, worker: Worker, error: LocalResourceError) -> Failure:
    """503 naming the gateway's own limit, not retried: another pair needs connections the
    gateway cannot open either, and the worker did nothing wrong."""
    log.error("the gateway cannot reach %s %s: %s", role, worker.id, error)
    message = (
        f"the gateway is out of its own resources, not the worker's: {error}. Raise the "
        "gateway's open-files limit or lower --max-client-connections"
    )
    return Failure(role, worker, False, Answer(503, error_body(message, "gateway_overloaded")))


def passed_headers(reply: Reply) -> tuple[tuple[str, str], ...]:
    """What of the decode's head a stream passes on to the client."""
    found = ((name, reply.header(name)) for name in _PASSED_HEADERS)
    return tuple(
        (name.decode(), value.decode("latin-1")) for name, value in found if value is not None
    )
