"""A request's way in, one sequence at every entry point: the gateway's handler (and with
it a decode's sidecar) and the endpoint picker run this, then route what it admitted.

1. **read** (`gateway.serving.reading`): a body or header that cannot be read is the
   client's 400, an adapter none serves a 404 (`refusal`), before the request waits for
   anything: a bad request is refused whatever the load;
2. **looked up** in the index (`Router.look_up`) first only under flow control, whose
   headroom reads the prompt's hits on each prefill to predict its first token;
3. **admitted**: with `--flow-control`, its turn in the flow queues (`gateway.flow.control`);
   else, with `--max-concurrent-requests`, a place under admission control
   (`gateway.flow.admission`); a refusal is that queue's 429 or 408;
4. **looked up** once admitted where it was not yet, or again when it waited: the index
   may show more of its prompt by then, and the route is chosen on what it shows now, not
   on what it showed when it came. Under admission control (or no limit) this is the one
   lookup, so a request the queue refuses costs the index nothing: under overload the
   lookups stay bounded by what is admitted;
5. **narrowed** to the prefills flow control released it for (`RouteQuery.within`): the
   prefill the router then chooses, by its own policy, is one where the request's first
   token is predicted within its objective and the headroom above it is kept.

The route is the caller's (the gateway's dispatcher calls the pair, the picker names the
endpoints), and so is the end of the place the request holds (`Place.release`, once the
answer is over). The place is marked `sent` before `admit` returns: the caller routes
without awaiting in between, so the load it starts replaces what flow control counted.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import ParamSpec, Protocol, TypeVar

from gateway.flow.admission import Admission
from gateway.flow.control import FlowControl
from gateway.flow.queues import FlowRequest
from gateway.http.answer import Answer, problem
from gateway.requests.bodies import BadRequest
from gateway.requests.headers import Picked
from gateway.requests.namespace import UnknownAdapter
from gateway.requests.query import RouteQuery
from gateway.requests.request import Request
from gateway.serving.reading import INFERENCE_PATHS, RequestReader
from gateway.serving.service import Gateway
from gateway.telemetry.tracing import current
from globalkv.tokenize import TokenizeError

P = ParamSpec("P")
R = TypeVar("R")
Waiting = Callable[[], Awaitable[None]] | None
"""Awaited once a request starts waiting in a queue (the picker asks its data plane for
the time the wait may take)."""
UNREADABLE = (BadRequest, TokenizeError, UnknownAdapter)
"""What reading a request (or its first attempt) raises for the client's mistakes."""


class Place(Protocol):
    """What an admitted request holds: flow control's `Grant`, or a place under admission
    control. `sent` once its load is tracked, `started` once its answer starts, `release`
    once it is over (each idempotent)."""

    waited: bool
    """It waited in a queue."""
    within: frozenset[str] | None
    """The prefills it was released for; None: any."""

    def sent(self) -> None: ...

    def started(self) -> None: ...

    def release(self) -> None: ...


# Built per request: its own __init__, compiled where the module is (the dataclass gives
# eq and repr only; its generated __init__ runs interpreted): docs/gateway-design.md.
@dataclass(slots=True, init=False)
class Admitted:
    request: Request | None
    """None for a path that is not inference (the picker routes those by load)."""
    query: RouteQuery
    place: Place | None
    """None when nothing limits the requests."""

    def __init__(self, request: Request | None, query: RouteQuery, place: Place | None) -> None:
        self.request = request
        self.query = query
        self.place = place


class Intake:
    """The sequence for one entry point. `named_prefill`: it binds a request to the prefill
    its picker named (a decode's sidecar). `traced`: the lookups and the wait are stages of
    the request's span, which the caller binds (`gateway.telemetry.tracing`)."""

    def __init__(
        self, gateway: Gateway, *, named_prefill: bool = False, traced: bool = False
    ) -> None:
        config = gateway.config
        self.flow: FlowControl | None = gateway.flow
        self.reader = RequestReader(
            gateway.router,
            gateway.tokenizer,
            None if self.flow is None else self.flow.keys,
            named_prefill=named_prefill,
        )
        self.admission = (
            Admission(config.admission, gateway.clock, gateway.metrics.registry)
            if config.admission.max_concurrent_requests > 0 and self.flow is None
            else None
        )
        """sglang-router's admission control, without flow control (which then holds it)."""
        self._router = gateway.router
        self._look_up: Callable[[RouteQuery], Awaitable[None]] = gateway.router.look_up
        self._enter: Callable[[FlowRequest | None, Waiting], Awaitable[Place | Answer | None]]
        self._enter = self._queue
        self._limited = self.flow is not None or self.admission is not None
        self._indexed = traced or gateway.router.uses_index
        """Whether the index is asked (or the lookup is a stage of a traced request's
        span): else the lookup is not awaited, a coroutine fewer per request."""
        self.admits_now = self.flow is None
        """A request may be admitted without awaiting (`admit_now`): no flow control, whose
        queues always decide (admission control's place is taken at once when one is
        free)."""
        self.looks_up = self._indexed
        """The index is asked for each request: the caller of `admit_now` awaits
        `look_up` before routing it."""
        if traced:
            self._look_up = _stage("route", self._look_up)
            if self.flow is not None or self.admission is not None:
                self._enter = _stage("queue", self._queue)

    async def admit(
        self,
        path: str,
        body: bytes,
        picked: Picked,
        authorization: str | None = None,
        waiting: Waiting = None,
        prefills: Collection[str] | None = None,
        *,
        request_id: str | None = None,
        trace_context: Sequence[tuple[bytes, bytes]] = (),
    ) -> Admitted | Answer:
        """The request read, looked up and admitted, or the refusal to answer instead (the
        request then holds nothing). `path`: without its query string; one that is not
        inference is routed by load alone (the picker's). `picked`: the request's
        `reader.header_names` it sent; `prefills`: the only prefills the caller may choose
        among, when it is bounded; `request_id` and `trace_context`: what of its headers
        the workers are sent (`RequestReader.read`)."""
        request: Request | None = None
        flow: FlowRequest | None = None
        if path not in INFERENCE_PATHS:
            query = RouteQuery(None, missing="not_inference")
        else:
            try:
                request, flow = await self.reader.read(
                    path, body, picked, authorization, request_id, trace_context
                )
            except UNREADABLE as exc:
                return refusal(exc)
            query = request.query
            if flow is not None:
                flow.among = prefills
        if not self._limited:  # nothing to wait for: looked up, admitted
            if self._indexed:
                await self._look_up(query)
            else:
                self._router.unindexed(query)
            return Admitted(request, query, None)
        flow_held = self.flow is not None and flow is not None
        if flow_held:
            await self._look_up(query)
        place = await self._enter(flow, waiting)
        if isinstance(place, Answer):
            return place
        if not flow_held or (place is not None and place.waited):
            try:
                await self._look_up(query)
            except BaseException:
                if place is not None:
                    place.release()
                raise
        if place is not None:
            query.within = place.within
            place.sent()
        return Admitted(request, query, place)

    def admit_now(
        self,
        path: str,
        body: bytes,
        picked: Picked,
        authorization: str | None,
        request_id: str,
        trace_context: Sequence[tuple[bytes, bytes]],
    ) -> tuple[Request, Place | None] | None:
        """`admit` of an inference request without awaiting, where the entry point
        `admits_now`, the body is one `RequestReader.read_now` reads and, under admission
        control, a place is free at once: the request and the place it holds (None without
        a limit); None where it is not so (then `admit` it). Where the entry point
        `looks_up`, the caller awaits `look_up(request.query)` before routing it. Raises what
        `UNREADABLE` names."""
        read = self.reader.read_now(path, body, picked, authorization, request_id, trace_context)
        if read is None:
            return None
        admission = self.admission
        seat = None
        if admission is not None:
            if not admission.admit_now():
                return None
            seat = _Seat(admission)
        request = read[0]
        if not self._indexed:
            self._router.unindexed(request.query)
        return request, seat

    async def look_up(self, query: RouteQuery) -> None:
        """The index's answer for a request `admit_now` admitted (`looks_up`)."""
        await self._look_up(query)

    async def _queue(self, flow: FlowRequest | None, waiting: Waiting) -> Place | Answer | None:
        """The request's place: its turn in the flow queues, or one under admission control;
        None when neither holds it (no limit, or no flow: a path that is not inference)."""
        if self.flow is not None and flow is not None:
            return await self.flow.enter(flow, waiting)
        admission = self.admission
        if admission is None:
            return None
        seat = _Seat(admission)

        async def queued() -> None:
            seat.waited = True
            if waiting is not None:
                await waiting()

        refused = await admission.admit(queued)
        return seat if refused is None else refused


class _Seat:
    """A place under admission control."""

    __slots__ = ("_admission", "waited", "within")

    def __init__(self, admission: Admission) -> None:
        self._admission: Admission | None = admission
        self.waited = False
        self.within: frozenset[str] | None = None  # admission counts, it does not place

    def sent(self) -> None:
        pass  # admission counts requests, not where they go

    def started(self) -> None:
        pass  # only a request ending frees a place

    def release(self) -> None:
        admission, self._admission = self._admission, None
        if admission is not None:
            admission.release()


def refusal(exc: BaseException) -> Answer:
    """The client's answer for what `UNREADABLE` names: 404 for an adapter none serves,
    else 400; the message is the exception's."""
    if isinstance(exc, UnknownAdapter):
        return problem(404, str(exc), "NotFoundError")
    return problem(400, str(exc))


def _stage(name: str, step: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """`step`, a stage of the traced request it serves: a child span of the request's."""

    async def in_span(*args: P.args, **kwargs: P.kwargs) -> R:
        trace = current()
        assert trace is not None, "bound by the request's span"
        span = trace.stage(name)
        try:
            return await step(*args, **kwargs)
        finally:
            span.end()

    return in_span
