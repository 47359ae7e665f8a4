"""One HTTP request's ext_proc stream: what it received, its pick and its release, and
what it may hold (`StreamLimits`: its body's size, the bytes all streams hold together in
`Budget`, its deadlines); the state machine `gateway.epp.server` drives, message by
message, in both body modes it describes. A request that waits in a queue (admission or
flow control) before its pick asks the data plane for the time the wait may take, once,
as it starts waiting: Envoy's message timeout would otherwise end it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest
from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.epp.picker import Pick, Picker
from gateway.epp.protocol import (
    Answers,
    ProtocolError,
    body_pieces,
    header_of,
    refuse,
    served_of,
    subset_of,
)
from gateway.http.answer import Answer, over_budget, problem, too_large
from gateway.requests.headers import LLMD_PREFILL_HEADER, PREFILL_HEADER

_BUFFERED = ProcessingMode.BUFFERED
_DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED


class EppMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.picks = Counter(
            "globalkv_epp_requests",
            "Requests the endpoint picker answered, by outcome (routed, or refused: "
            "bad_request, too_large, body_timeout, queue_full, queue_timeout, no_endpoint, "
            "shed, bodies_full)",
            ["outcome"],
            registry=registry,
        )
        self.streams = Counter(
            "globalkv_epp_stream_errors",
            "ext_proc streams aborted because Envoy's messages broke the protocol or asked "
            "for a body mode the picker cannot pick in",
            registry=registry,
        )
        self.expired = Counter(
            "globalkv_epp_picks_expired",
            "Picks whose load was released by --pick-timeout-secs, their stream still open",
            registry=registry,
        )
        self.buffered = Gauge(
            "globalkv_epp_buffered_bytes",
            "Request body bytes the picker holds now (bounded by --max-buffered-bytes)",
            registry=registry,
        )
        self.routed = self.picks.labels("routed")


@dataclass(frozen=True, slots=True)
class StreamLimits:
    body_bytes: int
    """One request's body, at most (beyond: 413)."""
    body_flag: str
    """The flag that sets `body_bytes`, named in the 413."""
    buffered_bytes: int
    """Every stream's body bytes held at once, at most (beyond: 503)."""
    body_secs: float
    """From the stream's start to the pick, at most (beyond: 408), unless the request
    waits in a queue: that wait is bounded by the queue's timeout."""
    pick_secs: float
    """A pick's load held, at most (beyond: released and the stream ended)."""


_OUTCOMES = {
    400: "bad_request",
    408: "queue_timeout",
    413: "too_large",
    503: "no_endpoint",
}


class Budget:
    """The request body bytes every stream of this process holds, bounded; the gauge
    reads it when scraped."""

    __slots__ = ("held", "limit")

    def __init__(self, limit: int, gauge: Gauge) -> None:
        self.limit = limit
        self.held = 0
        gauge.set_function(lambda: self.held)

    def take(self, size: int) -> bool:
        if self.held + size > self.limit:
            return False
        self.held += size
        return True

    def give(self, size: int) -> None:
        self.held -= size


class Stream:
    """One HTTP request's ext_proc stream: what was received, the pick, its release."""

    __slots__ = (
        "_answers",
        "_body",
        "_budget",
        "_end",
        "_headers",
        "_held",
        "_limits",
        "_metrics",
        "_path",
        "_picker",
        "_subset",
        "_trailers",
        "_whole",
        "_write",
        "buffered",
        "deadline",
        "duplex_response",
        "expired",
        "pick",
        "refused",
        "status",
        "task",
    )

    def __init__(
        self,
        picker: Picker,
        answers: Answers,
        limits: StreamLimits,
        budget: Budget,
        metrics: EppMetrics,
        write: Callable[[bytes], None],
    ) -> None:
        self._picker = picker
        self._write = write
        """Writes an answer to the data plane out of turn (while the pick waits)."""
        self._answers = answers
        self._limits = limits
        self._budget = budget
        self._metrics = metrics
        self._path: str | None = None
        self._headers: dict[str, str] = {}
        """The request headers the picker reads (`Picker.headers`)."""
        self._subset: frozenset[str] | None = None
        self._body = bytearray()
        self._whole: bytes | None = None
        """A BUFFERED body, whole in one message."""
        self._end: bool | None = True
        """Whether the body the pick answers ends the request (None: it has no body)."""
        self._trailers = False
        """The request's trailers ended it (the pick answers them too)."""
        self._held = 0
        self.buffered = False
        self.duplex_response = True
        self.pick: Pick | None = None
        self.refused = False
        self.status: int | None = None
        """The response's status, once its headers came."""
        self.deadline = 0.0
        """When the body must have come, or (picked) the pick's load stops counting."""
        self.task: asyncio.Task[Any] | None = None
        self.expired = False

    def receive(self, message: ProcessingRequest) -> list[bytes] | None:
        """The answers to one message before the pick, or None when the pick is due
        (`routed` answers then): only the pick awaits, so the messages before it cost no
        coroutine of their own."""
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            return self._request_headers(message)
        if self._path is None:
            raise ProtocolError(f"{kind} before the request headers")
        if kind == "request_body":
            return self._request_body(message.request_body)
        if kind == "request_trailers" and not self.buffered:
            self._end, self._trailers = False, True
            return None
        raise ProtocolError(f"{kind} before the request was routed")

    def after_pick(self, message: ProcessingRequest) -> list[bytes]:
        """The answers to one message after the pick (or after its load ended)."""
        kind = message.WhichOneof("request")
        answers = self._answers
        if kind == "response_headers":
            self._response_headers(message)
            return [answers.response_headers]
        if kind == "response_body":
            chunk = message.response_body
            if chunk.end_of_stream:
                self.release(True)
            if self.duplex_response:
                return list(body_pieces(chunk.body, request=False, end=chunk.end_of_stream))
            return [answers.response_body]
        if kind == "response_trailers":
            self.release(True)
            return [answers.response_trailers]
        if kind == "request_trailers":
            return [answers.request_trailers]
        raise ProtocolError(f"{kind} after the request was routed")

    def _request_headers(self, message: ProcessingRequest) -> list[bytes] | None:
        if self._path is not None:
            raise ProtocolError("request headers received twice")
        if message.HasField("protocol_config"):
            config = message.protocol_config
            mode = config.request_body_mode
            if mode not in (_BUFFERED, _DUPLEX):
                raise Unsupported(
                    f"request body mode {ProcessingMode.BodySendMode.Name(mode)}: the picker "
                    "reads the prompt before the request leaves; configure BUFFERED or "
                    "FULL_DUPLEX_STREAMED"
                )
            self.buffered = mode == _BUFFERED
            self.duplex_response = config.response_body_mode == _DUPLEX
        headers = message.request_headers
        path, self._headers = self._picker.headers.read(headers)
        self._path = path or "/"
        self._subset = subset_of(message.metadata_context)
        if headers.end_of_stream:
            self._end = None  # no body
            return None
        return [self._answers.request_headers] if self.buffered else []

    def _request_body(self, body: Any) -> list[bytes] | None:
        chunk: bytes = body.body
        size = len(chunk)
        limits = self._limits
        if self._held + size > limits.body_bytes:
            return [self._refuse(too_large(limits.body_bytes, limits.body_flag), "too_large")]
        if not self._budget.take(size):
            return [self.bodies_full()]
        self._held += size
        if self.buffered:  # the whole body, in one message
            self._whole = chunk
            return None
        self._body += chunk
        return None if body.end_of_stream else []

    async def routed(self) -> list[bytes]:
        """The pick's answer, once `receive` said it is due: in the buffered body's answer,
        else in the request headers' followed by the body streamed back (and the
        trailers' answer, when the trailers ended the request)."""
        assert self._path is not None
        end = self._end
        body = self._whole
        if body is None:
            body = bytes(self._body)
        try:
            outcome = await self._picker.pick(
                self._path, body, self._subset, self._headers, self._waiting
            )
        finally:
            self.forget_body()
        if isinstance(outcome, Answer):
            return [self._refuse(outcome)]
        self.pick = outcome
        self._metrics.routed.inc()
        in_body = self.buffered and end is not None
        removed = () if outcome.headers else _PREFILL_HEADERS
        answers = [
            self._answers.route(outcome.endpoints, outcome.headers, removed, in_body=in_body)
        ]
        if end is not None and not in_body:
            answers += body_pieces(body, request=True, end=end)
        if self._trailers:
            answers.append(self._answers.request_trailers)
        return answers

    async def _waiting(self) -> None:
        """The request waits in a queue before its pick: the data plane is asked to wait
        for it up to the picker's `wait_secs` (its message timeout, 30 s in the Envoy
        `globalkv envoy` configures, would end the wait sooner), and the stream's own
        deadline, which bounded the body's arrival, moves as far."""
        secs = self._picker.wait_secs
        self.deadline = asyncio.get_running_loop().time() + secs
        self._write(self._answers.more_time(secs))

    def forget_body(self) -> None:
        """The body's bytes no longer count against the process's budget."""
        if self._held:
            self._budget.give(self._held)
            self._held = 0
        if self._body:
            self._body = bytearray()
        self._whole = None

    def _refuse(self, answer: Answer, outcome: str | None = None) -> bytes:
        """`answer` as the data plane's immediate response, counted under `outcome` (by
        default, its status's)."""
        self.refused = True
        self.forget_body()
        outcome = outcome or _outcome(answer)
        self._metrics.picks.labels(outcome).inc()
        return refuse(answer, outcome)

    def bodies_full(self) -> bytes:
        """The refusal of a body the process has no room left for."""
        limits = self._limits
        full = over_budget(limits.buffered_bytes, "--max-buffered-bytes")
        return self._refuse(full, "bodies_full")

    def timed_out(self) -> bytes:
        message = f"the request body did not arrive within {self._limits.body_secs:g} s"
        return self._refuse(problem(408, message), "body_timeout")

    def _response_headers(self, message: ProcessingRequest) -> None:
        pick = self.pick
        if pick is None:
            return
        served = served_of(message.metadata_context)
        if served is not None:
            self._picker.served(pick, served)
        status = header_of(message.response_headers, ":status") or ""
        self.status = int(status) if status.isdigit() else 502
        self._picker.answered(pick, self.status)
        if message.response_headers.end_of_stream:
            self.release(True)

    def release(self, ended: bool) -> None:
        """The pick's load ends; `ended`: the response ended (not the stream cut short).
        Its success is the response's status when its headers came, else its ending."""
        pick = self.pick
        if pick is not None:
            self.pick = None
            succeeded = ended and (self.status is None or self.status < 300)
            self._picker.release(pick, succeeded)


def _outcome(answer: Answer) -> str:
    """A refusal's outcome, by its status; a 429 by what refused it: the picker's own
    shedding (`--shed-in-flight`, an "overloaded" error) or a queue's limit (admission's or
    flow control's, each counting its reasons in its own metric)."""
    if answer.status == 429:
        return "shed" if _error_type(answer.body) == "overloaded" else "queue_full"
    return _OUTCOMES.get(answer.status, str(answer.status))


def _error_type(body: bytes) -> str | None:
    """The `type` of an OpenAI error object in `body`; None if it holds none."""
    try:
        error = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    kind = error.get("type") if isinstance(error, dict) else None
    return kind if isinstance(kind, str) else None


_PREFILL_HEADERS = (PREFILL_HEADER, LLMD_PREFILL_HEADER)
"""Removed from a request sent whole: only the picker names a prefill."""


class Unsupported(ProtocolError):
    """A processing mode the picker cannot pick in."""
