"""One inference request as it is served, from the entry point that read it to the legs
that call its workers.

`Request` is made once, complete, by the entry point's reader (`gateway.serving.reading`):
the body as parsed, what choosing reads of it, the path the workers are called at, and
what of the client's headers every call passes on. The dispatcher, the chooser and the
legs read it and never change it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.requests.bodies import ParsedRequest
from gateway.requests.query import RouteQuery


# Built per request: its own __init__, compiled where the module is (the dataclass gives
# eq and repr only; its generated __init__ runs interpreted): docs/gateway-design.md.
@dataclass(slots=True, init=False)
class Request:
    path: str
    """The path it came to: the workers are called at the same."""
    parsed: ParsedRequest
    query: RouteQuery
    """What choosing reads of it, the same for all its attempts (the way in,
    `gateway.serving.intake`, adds the index's answer before the first)."""
    request_id: str | None
    """The client's request id, or one made (`gateway.serving.edge`), sent on to the
    workers; None where the request reaches no worker from here (an endpoint picker's)."""
    trace_context: Sequence[tuple[bytes, bytes]]
    """The client's W3C trace context, sent on to the workers as it came; none when the
    gateway traces (each call then carries its own span's)."""

    def __init__(
        self,
        path: str,
        parsed: ParsedRequest,
        query: RouteQuery,
        request_id: str | None = None,
        trace_context: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        self.path = path
        self.parsed = parsed
        self.query = query
        self.request_id = request_id
        self.trace_context = trace_context
