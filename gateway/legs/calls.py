"""The calls of an attempt to its pair, each with its bookkeeping, for every PD protocol.

A prefill call carries its load (queued tokens, pending prompt blocks) until it ends and
is then recorded (`gateway.legs.outcomes`, which also judges every failure); a decode call
carries its in-flight count and is raced against the prefill's call: until the decode's
first body byte exists nothing is committed to the client, so a prefill failure in that
window cancels the decode and ends the attempt (retried by the dispatcher), a prefill 4xx
is the client's fault and returned, and a decode transport error or retryable status
fails the attempt.
After the first byte a failure can only end the stream.

A prefill call may outlive its request (its decode answered first); `drain` waits for
those, whether awaited here or followed by callbacks (`gateway.legs.relayed`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import httpx

from gateway.http.answer import Answer, Outcome
from gateway.http.reply import Listener, Reply
from gateway.http.upstream import Extra, PooledUpstream, Upstream
from gateway.legs.attempt import Failure
from gateway.legs.deadline import Progress
from gateway.legs.outcomes import CallOutcomes, passed_headers
from gateway.legs.racing import Call, failed, race, settle
from gateway.load.tracker import LoadTicket, LoadTracker
from gateway.routing.plan import RoutePlan
from gateway.settings.base import Role
from gateway.telemetry.metrics import GatewayMetrics
from gateway.workers.pool import Worker
from kvplumbing.clock import Clock

log = logging.getLogger(__name__)
T = TypeVar("T")
_PASSED_HEADERS = (b"cache-control", b"x-request-id")


class PairCalls(CallOutcomes):
    def __init__(
        self,
        upstream: Upstream,
        loads: LoadTracker,
        metrics: GatewayMetrics,
        *,
        timeout: float,
        clock: Clock,
    ) -> None:
        super().__init__(loads, metrics, clock)
        self._upstream = upstream
        self._timeout = timeout
        self._background: set[Call] = set()
        self._relaying = upstream if isinstance(upstream, PooledUpstream) else None
        self._relayed: dict[Reply, Callable[[], None]] = {}
        """Prefill calls followed by callbacks (`gateway.legs.relayed`), each with what
        cancels it."""
        self._relayed_gone: asyncio.Future[None] | None = None

    @property
    def relays(self) -> bool:
        """Calls may be followed by callbacks (`relay`): the gateway's own pool."""
        return self._relaying is not None

    def relay(
        self, url: str, payload: bytes, extra: Extra, *, whole: bool, listener: Listener
    ) -> Reply:
        """A call `listener` follows, read timeout as for every call (needs `relays`)."""
        assert self._relaying is not None
        return self._relaying.relay(
            url, payload, self._timeout, extra, whole=whole, listener=listener
        )

    def relayed_prefill(self, reply: Reply, cancel: Callable[[], None]) -> None:
        """A prefill call followed by callbacks, which `drain` waits for (or `cancel`s)."""
        self._relayed[reply] = cancel

    def relayed_prefill_ended(self, reply: Reply) -> None:
        self._relayed.pop(reply, None)
        gone = self._relayed_gone
        if not self._relayed and gone is not None and not gone.done():
            gone.set_result(None)

    async def drain(self, timeout: float | None = None) -> None:
        """Wait for prefill calls that outlived their request (tests, shutdown); those
        still running after `timeout` seconds are cancelled."""
        waiting: list[asyncio.Future[Any]] = list(self._background)
        if self._relayed:
            self._relayed_gone = asyncio.get_running_loop().create_future()
            waiting.append(self._relayed_gone)
        if waiting and timeout is not None:
            await asyncio.wait(waiting, timeout=timeout)
            for call in list(self._background):
                call.cancel()
            for cancel in list(self._relayed.values()):
                cancel()
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)
        if self._relayed and self._relayed_gone is not None:
            await self._relayed_gone

    def start_prefill(self, plan: RoutePlan, path: str, payload: bytes, extra: Extra = ()) -> Call:
        """The prefill's call, its load and breaker bookkeeping attached."""
        ticket = self.prefill_load(plan)
        call = asyncio.ensure_future(
            self._upstream.fetch(plan.prefill.url + path, payload, self._timeout, extra)
        )
        self._background.add(call)
        call.add_done_callback(partial(self._prefill_ended, plan.prefill, ticket))
        return call

    def _prefill_ended(self, worker: Worker, ticket: LoadTicket, call: Call) -> None:
        self._background.discard(call)
        if call.cancelled():
            self.loads.finish(ticket, False)
            return
        error = call.exception()
        self.prefill_ended(worker, ticket, None if error is not None else call.result(), error)

    def prefill_load(self, plan: RoutePlan) -> LoadTicket:
        """The load of the plan's prefill: its uncached tokens queue there and its keys are
        pending there until it answers; for a decode that prefills the prompt itself
        (`plan.prefill` is the decode), until its first token (`decode(ticket=…)`)."""
        return self.loads.start_prefill(plan.prefill_choice, plan.keys, plan.dp_rank)

    @staticmethod
    def prefill_failure(plan: RoutePlan, call: Call) -> Failure:
        """What a failed prefill call answers the client, and whether to retry."""
        error = call.exception()
        return CallOutcomes.prefill_failed(
            plan, None if error is not None else call.result(), error
        )

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
        """The decode's answer (whole, or a stream from its first byte), unless the prefill
        `call` fails first; `ticket`: the decode's load when the caller started it
        (`prefill_load`)."""
        if ticket is None:
            ticket = self.loads.start_decode(plan.decode.id)
        url = plan.decode.url + path
        if stream:
            return await self._streamed(plan, call, ticket, url, payload, progress, extra)
        return await self._whole(plan, call, ticket, url, payload, extra)

    async def _decode_step(
        self, plan: RoutePlan, call: Call, step: asyncio.Future[T], when: str
    ) -> T | Failure:
        """`step`'s result (a step of the decode's call), unless the prefill `call` fails
        first or `step` fails (`when`: what the decode failed to do)."""
        if not await race(step, call):
            return self.prefill_failure(plan, call)
        try:
            return step.result()
        except httpx.HTTPError as exc:
            return self.decode_error(plan.decode, exc, when)

    def _decode_refused(self, plan: RoutePlan, call: Call, answer: Answer) -> Failure:
        prefill = self.prefill_failure(plan, call) if failed(call) else None
        return self.decode_refused(plan, answer, prefill)

    async def _whole(
        self,
        plan: RoutePlan,
        call: Call,
        ticket: LoadTicket,
        url: str,
        payload: bytes,
        extra: Extra,
    ) -> Answer | Failure:
        step = asyncio.ensure_future(self._upstream.fetch(url, payload, self._timeout, extra))
        outcome: Answer | Failure | None = None
        error: BaseException | None = None
        # The calls are ended after the try, then what it raised is raised on: not in a
        # finally, where an await loses the exception in flight once mypyc compiles this
        # (bench.gateway_compiled).
        try:
            reply = await self._decode_step(plan, call, step, "to answer")
            outcome = reply if isinstance(reply, Failure) else self._decoded(plan, call, reply)
        except BaseException as exc:
            error = exc
        succeeded = isinstance(outcome, Answer)
        self.loads.finish(ticket, succeeded, timed=False)
        if not step.done():
            step.cancel()
            await settle(step)
        if not succeeded:
            call.cancel()
        if error is not None:
            raise error
        assert outcome is not None
        return outcome

    def _decoded(self, plan: RoutePlan, call: Call, reply: Reply) -> Answer | Failure:
        """The decode's whole answer, or its refusal (the prefill's, where it failed)."""
        prefill = self.prefill_failure(plan, call) if reply.status >= 400 and failed(call) else None
        return self.decoded(plan, reply, prefill)

    async def _streamed(
        self,
        plan: RoutePlan,
        call: Call,
        ticket: LoadTicket,
        url: str,
        payload: bytes,
        progress: Progress,
        extra: Extra,
    ) -> Answer | Failure:
        opening = _Opening(
            asyncio.ensure_future(self._upstream.open(url, payload, self._timeout, extra))
        )
        outcome: Answer | Failure | None = None
        error: BaseException | None = None
        try:
            outcome = await self._first_piece(plan, call, ticket, opening, progress)
        except BaseException as exc:  # as in _whole: no await in a finally
            error = exc
        if not isinstance(outcome, Answer):  # nothing committed to the client
            await self._not_opened(call, ticket, opening)
        if error is not None:
            raise error
        assert outcome is not None
        return outcome

    async def _first_piece(
        self, plan: RoutePlan, call: Call, ticket: LoadTicket, opening: _Opening, progress: Progress
    ) -> Answer | Failure:
        """The decode's stream from its first piece, unless it or the prefill `call` failed
        first; `opening` keeps what was opened, for `_not_opened`."""
        opened = await self._decode_step(plan, call, opening.call, "to answer")
        if isinstance(opened, Failure):
            return opened
        reply = opening.reply = opened
        if reply.status >= 400:
            try:
                content = await reply.read()
            except httpx.HTTPError as exc:
                return self.decode_error(plan.decode, exc, "mid-answer")
            return self._decode_refused(plan, call, Answer(reply.status, content, reply.media_type))
        progress.decode_head = True
        opening.step = asyncio.ensure_future(reply.next())
        first = await self._decode_step(plan, call, opening.step, "before its first byte")
        if isinstance(first, Failure):
            return first
        self.loads.prefill_done(ticket)
        rest = _DecodeStream(self.loads, self.record, reply, plan, ticket, call)
        return Answer(reply.status, first, reply.media_type, passed_headers(reply), rest)

    async def _not_opened(self, call: Call, ticket: LoadTicket, opening: _Opening) -> None:
        """A stream that committed nothing: its calls cancelled and closed, its load ended."""
        opening.step.cancel()
        opening.call.cancel()
        await settle(opening.step, opening.call)
        reply = opening.reply
        if reply is None and opening.call.done() and not opening.call.cancelled():
            reply = None if opening.call.exception() else opening.call.result()
        if reply is not None:
            await reply.aclose()
        self.loads.finish(ticket, computed=False)
        call.cancel()


class _Opening:
    """A streamed decode call being opened: the call, the step awaited now (the call, then
    its first piece) and its reply once it has one."""

    __slots__ = ("call", "reply", "step")

    def __init__(self, call: asyncio.Future[Reply]) -> None:
        self.call = call
        self.step: asyncio.Future[Any] = call
        self.reply: Reply | None = None


class _DecodeStream:
    """The decode's stream after its first piece (`gateway.http.answer.Rest`)."""

    __slots__ = ("_call", "_decode", "_loads", "_record", "_reply", "_ticket")

    def __init__(
        self,
        loads: LoadTracker,
        record: Callable[[Role, Worker, int | None, str], None],
        reply: Reply,
        plan: RoutePlan,
        ticket: LoadTicket,
        call: Call,
    ) -> None:
        self._loads = loads
        self._record = record
        self._reply = reply
        self._decode = plan.decode
        self._ticket = ticket
        self._call = call

    def next(self) -> asyncio.Future[bytes]:
        return self._reply.next()

    async def close(self, outcome: Outcome) -> None:
        """ "client_gone" cancels a prefill still running and records nothing; otherwise the
        decode's breaker records the outcome."""
        await self._reply.aclose()
        self._loads.finish(self._ticket)
        if outcome == "client_gone":
            self._call.cancel()
        else:
            self._record("decode", self._decode, 200 if outcome == "done" else None, outcome)
