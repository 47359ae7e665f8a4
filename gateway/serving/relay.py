"""One inference request answered by callbacks, from its complete body to its last byte.

Why: a request served by a task (`gateway.serving.inference.Inference.handle`) walks a
chain of coroutines — the exchange, the handler, the dispatcher, the legs, a race of two
futures — and each step costs the event loop a wake-up and the interpreter a frame. A
request that needs nothing awaited before its first attempt but the index's answer (its
one task, where the prefill policy reads the index) is instead taken over by a `Relay`
when the connection has read it (`Inference.begin`): its attempt is a
`gateway.legs.relayed.RelayedPair`, whose calls' callbacks report here, and the answer is
written from those callbacks. What it does is what the task does, through the same
methods: the reading, the metrics, the request id and CORS head lines, OpenAI's error
shape, the deadline (`Progress.expire` ends it with the 504), flow control on the stream
(the decode's connection paused while the client's is full). A failure to retry, or a
plan whose legs are not relayed, hands the request to a task
(`Inference.forwarded` with the attempt as `Begun`), which carries it on as the task path
would have from there, its deadline unchanged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from gateway.http.answer import Answer, Outcome, problem
from gateway.http.exchange import RelayWire, write_answer
from gateway.http.reply import Reply
from gateway.http.wire import CLOSE, LAST_CHUNK, HttpRequest, answer_bytes, chunk, stream_start
from gateway.http.wire import connection_header as _connection
from gateway.legs.attempt import Failure
from gateway.legs.deadline import Progress
from gateway.legs.dispatch import Begun, Dispatcher
from gateway.legs.outcomes import passed_headers
from gateway.legs.relayed import RelayedPair
from gateway.legs.sglang import DualLegs
from gateway.requests.query import RouteQuery
from gateway.requests.request import Request
from gateway.serving.intake import UNREADABLE, Place, refusal
from gateway.telemetry.metrics import EndpointMetrics
from kvplumbing.clock import Clock

log = logging.getLogger(__name__)


class Served(Protocol):
    """What a relay needs of the handler it serves for (`Inference`)."""

    def headed(self, answer: Answer, request_id: str, origin: bytes | None) -> Answer: ...

    def whole(
        self, path: str, metrics: EndpointMetrics, started: float, answer: Answer
    ) -> Answer: ...

    def shaped(self, path: str, answer: Answer) -> Answer: ...

    def measured(self, metrics: EndpointMetrics, started: float, status: int) -> None: ...

    def gone(self, metrics: EndpointMetrics, started: float) -> None: ...

    def stream_ended(
        self,
        metrics: EndpointMetrics,
        started: float,
        status: int,
        place: Place | None,
        outcome: Outcome,
    ) -> None: ...

    async def forwarded(
        self,
        request: Request,
        metrics: EndpointMetrics,
        started: float,
        place: Place | None,
        progress: Progress | None,
        first: Begun | None,
    ) -> Answer: ...


class Relay:
    """One request, answered by callbacks on its client's connection (`Relaying`)."""

    __slots__ = (
        "_clock",
        "_dispatcher",
        "_done",
        "_http",
        "_keep",
        "_look_up",
        "_lookup",
        "_metrics",
        "_origin",
        "_pair",
        "_place",
        "_progress",
        "_reply",
        "_request",
        "_request_id",
        "_served",
        "_started",
        "_status",
        "_task",
        "_wire",
    )

    def __init__(
        self,
        served: Served,
        dispatcher: Dispatcher,
        wire: RelayWire,
        http: HttpRequest,
        request: Request,
        metrics: EndpointMetrics,
        clock: Clock,
        started: float,
        request_id: str,
        origin: bytes | None,
        look_up: Callable[[RouteQuery], Coroutine[Any, Any, None]] | None = None,
        place: Place | None = None,
    ) -> None:
        """`look_up`: the index is asked for the request's prompt first (in a task: the
        one await before its first attempt). `place`: what it holds under admission
        control, given back once its answer is over."""
        self._served = served
        self._place = place
        self._look_up = look_up
        self._clock = clock
        self._dispatcher = dispatcher
        self._wire = wire
        self._http = http
        self._request = request
        self._metrics = metrics
        self._started = started
        self._request_id = request_id
        self._origin = origin
        self._progress: Progress | None = None
        self._pair: RelayedPair | None = None
        """The attempt in progress, until it answered or failed."""
        self._reply: Reply | None = None
        """The decode's stream being passed on."""
        self._task: asyncio.Task[None] | None = None
        """The task carrying the request on (a retry), when one does."""
        self._lookup: asyncio.Task[None] | None = None
        """The index's lookup for the request, while it runs."""
        self._status = 0
        self._keep = False
        self._done = False
        """The answer is over: the connection has been told."""

    # gateway.http.exchange.Relaying

    def start(self) -> None:
        look_up = self._look_up
        if look_up is None:
            self._attempt_guarded()
            return
        lookup = asyncio.get_running_loop().create_task(look_up(self._request.query))
        lookup.add_done_callback(self._looked_up)
        self._lookup = lookup

    def _looked_up(self, task: asyncio.Task[None]) -> None:
        self._lookup = None
        if task.cancelled() or self._done:
            return  # the client left: `cancel` answered for it
        error = task.exception()
        if error is not None:
            log.error("error looking up POST %s", self._request.path, exc_info=error)
            self._finish(problem(500, "internal error"))
            return
        self._attempt_guarded()

    def _attempt_guarded(self) -> None:
        """`_attempt`; an unexpected error is answered 500 when nothing was written yet, as
        `Exchange.run` answers it (raised into the parser's callback, it would leave the
        client waiting)."""
        try:
            self._attempt()
        except Exception:
            log.exception("error serving POST %s", self._request.path)
            if not self._done and self._pair is None and self._task is None:
                self._finish(problem(500, "internal error"))

    def _attempt(self) -> None:
        """The first attempt begun (or its answer given, where it is a refusal)."""
        dispatcher = self._dispatcher
        self._progress = dispatcher.deadlines.start_by(self._expired)
        plan = dispatcher.first_plan(self._request)
        if isinstance(plan, Answer):
            self._finish(plan)
            return
        legs = dispatcher.legs(plan)
        if not isinstance(legs, DualLegs):
            self._carry_on(Begun(plan=plan))
            return
        pair = self._pair = RelayedPair(legs.calls, plan, self, self._progress)
        try:
            pair.start(self._request)
        except UNREADABLE as exc:  # the body cannot be bound to the prefill
            self._pair = None
            self._finish(refusal(exc))

    def cancel(self) -> None:
        if self._done:
            return
        if self._task is not None:
            self._task.cancel()  # it tells the connection as it ends
            return
        lookup, self._lookup = self._lookup, None
        if lookup is not None:
            lookup.cancel()
        self._done = True
        reply, self._reply = self._reply, None
        if reply is not None:  # a stream under way
            self._closed(reply, "client_gone")
        else:
            pair, self._pair = self._pair, None
            if pair is not None:
                pair.cancel()
            self._finish_deadline()
            self._release()
            self._served.gone(self._metrics, self._started)
        self._wire.answered(self._http, False)

    def drained(self) -> None:
        reply = self._reply
        if reply is not None and reply.connection is not None:
            reply.connection.resume()

    # gateway.legs.relayed.Owner

    def answered(self, answer: Answer) -> None:
        self._pair = None
        self._finish(answer)

    def opened(self, pair: RelayedPair, reply: Reply, first: bytes) -> None:
        self._pair = pair
        self._reply = reply
        self._finish_deadline()
        self._metrics.ttfb.observe(self._clock() - self._started)
        http = self._http
        answer = Answer(reply.status, first, reply.media_type, passed_headers(reply))
        answer = self._served.headed(answer, self._request_id, self._origin)
        self._status = answer.status
        if self._place is not None:
            self._place.started()
        keep = self._keep = http.keep_alive and self._wire.accepting()
        start = stream_start(answer, True, keep)
        if reply.done:  # all of it came with its first piece: one write
            rest = reply.take()
            self._wire.write(start + (chunk(rest) if rest else b"") + LAST_CHUNK)
            self._stream_over(reply, "done")
            return
        self._wire.write(start)
        reply.listener = self
        if self._wire.write_paused and reply.connection is not None:
            reply.connection.pause()

    def attempt_failed(self, failure: Failure) -> None:
        self._pair = None
        if self._dispatcher.retries(failure):
            self._carry_on(Begun(failure=failure))
        else:
            self._finish(failure.answer)

    # gateway.http.reply.Listener, for the decode's stream once opened

    def replied(self, reply: Reply) -> None:
        pass  # its head came before it was passed on

    def more(self, reply: Reply) -> None:
        wire = self._wire
        data = reply.take()
        if reply.done:
            wire.write(chunk(data) + LAST_CHUNK if data else LAST_CHUNK)
            self._stream_over(reply, "done")
            return
        if data:
            wire.write(chunk(data))
        if wire.write_paused and reply.connection is not None:
            reply.connection.pause()

    def failed(self, reply: Reply, error: BaseException) -> None:
        self._stream_over(reply, "upstream_error")

    # the answer's end

    def _stream_over(self, reply: Reply, outcome: Outcome) -> None:
        self._reply = None
        self._done = True
        self._closed(reply, outcome)
        self._wire.answered(self._http, outcome == "done" and self._keep)

    def _closed(self, reply: Reply, outcome: Outcome) -> None:
        pair, self._pair = self._pair, None
        assert pair is not None
        pair.closed(outcome, reply)
        place, self._place = self._place, None
        self._served.stream_ended(self._metrics, self._started, self._status, place, outcome)

    def _finish(self, answer: Answer) -> None:
        """A whole answer to write: shaped, headed, written, then measured; the request
        over (the client waits for no bookkeeping)."""
        served, http = self._served, self._http
        answer = served.headed(
            served.shaped(self._request.path, answer), self._request_id, self._origin
        )
        keep = http.keep_alive and self._wire.accepting()
        self._done = True
        self._wire.write(answer_bytes(answer, _connection(keep, http.version)))
        served.measured(self._metrics, self._started, answer.status)
        self._finish_deadline()
        self._release()
        self._wire.answered(http, keep)

    def _release(self) -> None:
        """The place the request held under admission control, given back."""
        place, self._place = self._place, None
        if place is not None:
            place.release()

    def _finish_deadline(self) -> None:
        progress = self._progress
        if progress is not None and not progress.finished:
            self._dispatcher.deadlines.finish(progress)

    def _expired(self) -> None:
        """The deadline passed before the answer began: the attempt abandoned, 504."""
        pair, self._pair = self._pair, None
        if pair is not None:
            pair.cancel()
        progress = self._progress
        assert progress is not None
        self._finish(self._dispatcher.timed_out(self._request, progress))

    # carried on by a task

    def _carry_on(self, first: Begun) -> None:
        self._task = asyncio.get_running_loop().create_task(self._carried(first))

    async def _carried(self, first: Begun) -> None:
        """The rest of the request in a task, from `first` on, as `Exchange.run` answers
        it: an unexpected error is a 500 when nothing was written yet."""
        http, wire = self._http, self._wire
        kept = False
        written = False
        try:
            try:
                place, self._place = self._place, None
                answer = await self._served.forwarded(
                    self._request, self._metrics, self._started, place, self._progress, first
                )
            except UNREADABLE as exc:  # a retry's BadRequest (`forwarded` kept the place)
                if place is not None:
                    place.release()
                answer = self._served.whole(
                    self._request.path, self._metrics, self._started, refusal(exc)
                )
            answer = self._served.headed(answer, self._request_id, self._origin)
            written = True
            kept = await write_answer(
                wire, answer, version=http.version, keep_alive=http.keep_alive and wire.accepting()
            )
        except asyncio.CancelledError:
            kept = False
        except Exception:
            log.exception("error serving POST %s", self._request.path)
            if not written:
                wire.write(answer_bytes(problem(500, "internal error"), CLOSE))
            kept = False
        self._done = True
        self._task = None
        wire.answered(http, kept)
