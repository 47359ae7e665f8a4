"""The legs' calls, each in a span, and the retries between them, for a gateway that traces.

`TracedCalls` is the `PairCalls` a gateway is built with when tracing is on
(`gateway.serving.service.build_gateway`): every call to a prefill or a decode is a client
span, a child of the request's (`gateway.telemetry.tracing.current`), whose context is the
`traceparent` that worker receives; a failed call's span says why, a stream's decode span
has a `first_byte` event and ends with the stream. `TracedDispatcher` is its `Dispatcher`:
each retry is a `retry` event of the request's span, naming the attempt that failed, its
role and its worker. A gateway that does not trace is built with `PairCalls` and
`Dispatcher` themselves and runs none of this.
"""

from __future__ import annotations

from functools import partial

from gateway.http.answer import After, Answer, Outcome
from gateway.http.upstream import Extra
from gateway.legs.attempt import Failure
from gateway.legs.calls import PairCalls
from gateway.legs.deadline import Progress
from gateway.legs.dispatch import Dispatcher
from gateway.legs.racing import Call
from gateway.load.tracker import LoadTicket
from gateway.requests.request import Request
from gateway.routing.plan import RoutePlan
from gateway.telemetry.tracing import CallTrace, TracedRequest, current


class TracedCalls(PairCalls):
    def start_prefill(self, plan: RoutePlan, path: str, payload: bytes, extra: Extra = ()) -> Call:
        span = _request().call("prefill", plan.prefill.id)
        call = super().start_prefill(plan, path, payload, (*extra, *span.headers))
        call.add_done_callback(partial(_prefill_ended, span))
        return call

    async def decode(
        self,
        plan: RoutePlan,
        call: Call,
        path: str,
        payload: bytes,
        *,
        stream: bool,
        progress: Progress,
        extra: Extra = (),
        ticket: LoadTicket | None = None,
    ) -> Answer | Failure:
        span = _request().call("decode", plan.decode.id)
        extra = (*extra, *span.headers)
        try:
            answer = await super().decode(
                plan,
                call,
                path,
                payload,
                stream=stream,
                progress=progress,
                extra=extra,
                ticket=ticket,
            )
        except BaseException:
            span.end(None, "cancelled")
            raise
        if isinstance(answer, Failure):
            span.end(answer.answer.status, f"the {answer.role} failed")
        elif answer.rest is not None:
            span.event("first_byte")
            answer.rest = After(answer.rest, partial(_stream_ended, span, answer.status))
        else:
            span.end(answer.status)
        return answer


class TracedDispatcher(Dispatcher):
    def retrying(self, request: Request, failure: Failure, attempt: int) -> None:
        super().retrying(request, failure, attempt)
        failed = {"attempt": attempt + 1, "role": failure.role, "worker": failure.worker.id}
        _request().event("retry", failed)


def _request() -> TracedRequest:
    trace = current()
    assert trace is not None, "a traced gateway binds every request's span"
    return trace


def _stream_ended(span: CallTrace, status: int, outcome: Outcome) -> None:
    span.end(status, None if outcome == "done" else outcome)


def _prefill_ended(span: CallTrace, call: Call) -> None:
    if call.cancelled():
        span.end(None, "cancelled")
        return
    error = call.exception()
    if error is None:
        span.end(call.result().status)
    else:
        span.end(None, f"{type(error).__name__}: {error}")
