"""SGLang's pair of calls followed by callbacks: a first attempt that costs no task.

`gateway.legs.sglang.DualLegs` runs an attempt as coroutines (a task per request, a future
per call, a race between them). A `RelayedPair` makes the same two calls on the gateway's
own connection pool with itself as both replies' listener (`gateway.http.reply.Listener`),
so the attempt advances inside the connections' protocol callbacks and reports to its
`Owner` — the request answered by callbacks, `gateway.serving.relay` — when it has an
answer to pass on, a stream from its first piece, or a failure. The rules are those of
the awaited legs, through the same methods (`gateway.legs.outcomes`): until the decode's first body
byte nothing is committed, so a prefill failing first cancels the decode and fails the
attempt (a prefill 4xx is the client's answer), a decode's transport error or status
fails it; every finished call is recorded in its worker's breaker, cancelled ones are
not; each call carries its load until it ends. A prefill may outlive its request (the
decode answered first): it is then followed to its end, and `PairCalls.drain` waits for
it.

Retries are the dispatcher's: a failure goes to the owner, which hands the request to a
task (`gateway.legs.dispatch.Dispatcher.forward` with the failure as attempt 0).
"""

from __future__ import annotations

from typing import Protocol

from gateway.http.answer import Answer, Outcome
from gateway.http.reply import Reply
from gateway.legs.attempt import Failure
from gateway.legs.calls import PairCalls
from gateway.legs.deadline import Progress
from gateway.legs.sglang import pair_payloads
from gateway.load.tracker import LoadTicket
from gateway.requests.request import Request
from gateway.routing.plan import RoutePlan


class Owner(Protocol):
    """What a relayed attempt reports to (each at most once, one of the three)."""

    def answered(self, answer: Answer) -> None:
        """The decode's whole answer, to pass on."""
        ...

    def opened(self, pair: RelayedPair, reply: Reply, first: bytes) -> None:
        """The decode's stream, from its `first` piece; the owner follows `reply` from
        now on and calls `pair.closed` once the stream is over."""
        ...

    def attempt_failed(self, failure: Failure) -> None:
        """The attempt ended without an answer to pass on."""
        ...


class RelayedPair:
    """One attempt on an SGLang pair, both calls followed by callbacks."""

    __slots__ = (
        "_calls",
        "_decided",
        "_decode",
        "_decode_ticket",
        "_owner",
        "_plan",
        "_prefill",
        "_prefill_ticket",
        "_progress",
        "_refusal",
        "_stream",
    )

    def __init__(self, calls: PairCalls, plan: RoutePlan, owner: Owner, progress: Progress) -> None:
        self._calls = calls
        self._plan = plan
        self._owner = owner
        self._progress = progress
        self._decided = False
        """The owner has been told (an answer, a stream or a failure)."""
        self._stream = False
        self._prefill: Reply | None = None
        """The prefill's call, until it ended."""
        self._decode: Reply | None = None
        """The decode's call, until it was answered, failed or abandoned."""
        self._prefill_ticket: LoadTicket | None = None
        self._decode_ticket: LoadTicket | None = None
        self._refusal: list[bytes] | None = None
        """A streamed decode's refusal (status >= 400), read whole before it is judged."""

    def start(self, request: Request) -> None:
        """Send both calls (`request` bound to the plan's prefill)."""
        calls, plan = self._calls, self._plan
        payload, decode_payload, extra = pair_payloads(request, plan)
        path = request.path
        self._stream = request.parsed.stream
        self._prefill_ticket = calls.prefill_load(plan)
        prefill = calls.relay(plan.prefill.url + path, payload, extra, whole=True, listener=self)
        self._prefill = prefill
        calls.relayed_prefill(prefill, self._abandon_prefill)
        self._progress.begin(0, plan.prefill.id, plan.decode.id, prefill)
        self._decode_ticket = calls.loads.start_decode(plan.decode.id)
        self._decode = calls.relay(
            plan.decode.url + path, decode_payload, extra, whole=not self._stream, listener=self
        )

    def cancel(self) -> None:
        """The request is over before its answer (the client left, or the deadline
        passed): both calls abandoned and their loads ended, nothing recorded."""
        self._decided = True
        self._abandon_decode()
        self._abandon_prefill()

    def closed(self, outcome: Outcome, reply: Reply) -> None:
        """The stream the owner was given is over: `client_gone` cancels a prefill still
        running and records nothing; otherwise the decode's breaker records `outcome`."""
        reply.close()
        ticket = self._decode_ticket
        assert ticket is not None
        self._calls.loads.finish(ticket)
        if outcome == "client_gone":
            self._abandon_prefill()
        else:
            status = 200 if outcome == "done" else None
            self._calls.record("decode", self._plan.decode, status, outcome)

    # gateway.http.reply.Listener, for both calls

    def replied(self, reply: Reply) -> None:
        if reply is self._prefill:
            self._prefill_ended(reply, None)
        elif self._decided:
            return
        elif not self._stream:
            answer = Answer(reply.status, reply.body, reply.media_type)
            if answer.status >= 400:
                self._fail(self._calls.decode_refused(self._plan, answer, None))
                return
            self._decided = True
            self._decode = None
            self._owner.answered(answer)  # written first: the client waits for no records
            self._calls.record("decode", self._plan.decode, answer.status, None)
            self._end_decode(True)
        elif reply.status >= 400:
            self._refusal = []
        else:
            self._progress.decode_head = True

    def more(self, reply: Reply) -> None:
        if self._decided:
            return
        refusal = self._refusal
        if refusal is not None:
            refusal.append(reply.take())
            if reply.done:
                answer = Answer(reply.status, b"".join(refusal), reply.media_type)
                self._fail(self._calls.decode_refused(self._plan, answer, None))
            return
        first = reply.take()
        if not first and not reply.done:
            return
        self._decided = True
        self._decode = None
        reply.listener = None
        ticket = self._decode_ticket
        assert ticket is not None
        self._owner.opened(self, reply, first)
        self._calls.loads.prefill_done(ticket)

    def failed(self, reply: Reply, error: BaseException) -> None:
        if reply is self._prefill:
            self._prefill_ended(reply, error)
            return
        if self._decided:
            return
        when = "to answer"
        if self._refusal is not None:
            when = "mid-answer"
        elif self._stream and self._progress.decode_head:
            when = "before its first byte"
        self._fail(self._calls.decode_error(self._plan.decode, error, when))

    # the calls' ends

    def _prefill_ended(self, reply: Reply, error: BaseException | None) -> None:
        """The prefill answered or failed: recorded; a failure before anything was
        committed fails the attempt (events arrive one at a time, so a prefill that failed
        first always takes precedence over the decode's answer)."""
        self._prefill = None
        calls = self._calls
        calls.relayed_prefill_ended(reply)
        ticket = self._prefill_ticket
        assert ticket is not None
        answered = None if error is not None else reply
        calls.prefill_ended(self._plan.prefill, ticket, answered, error)
        if not self._decided and (error is not None or reply.status >= 400):
            self._fail(calls.prefill_failed(self._plan, answered, error))

    def _fail(self, failure: Failure) -> None:
        """Nothing committed to the client: the decode's call abandoned, a prefill still
        running cancelled, and the owner told."""
        self._decided = True
        self._abandon_decode()
        self._abandon_prefill()
        self._owner.attempt_failed(failure)

    def _end_decode(self, succeeded: bool) -> None:
        ticket = self._decode_ticket
        assert ticket is not None
        self._calls.loads.finish(ticket, succeeded, timed=False)

    def _abandon_decode(self) -> None:
        decode, self._decode = self._decode, None
        if decode is not None:
            decode.close()
            self._end_decode(False)

    def _abandon_prefill(self) -> None:
        prefill, self._prefill = self._prefill, None
        if prefill is None:
            return
        prefill.close()
        self._calls.relayed_prefill_ended(prefill)
        ticket = self._prefill_ticket
        assert ticket is not None
        self._calls.loads.finish(ticket, False)
