"""A gRPC call as a service sees it: its messages cut out of the bytes that carry them and
handed to its handler, the verbs the handler answers with, and the status codes it ends
with. The HTTP/2 that carries calls is `gateway.epp.grpc_h2`'s.

A message is handed to the call's handler (`CallHandler`) as soon as it is whole, in
order. One over `Limits.max_message` ends its call with RESOURCE_EXHAUSTED as soon as its
length is read; one still arriving holds its declared size of the process's room
(`Room`, shared with what the services hold), and when that is full its handler is told
(`overflow`) and the bytes are dropped. A compressed message ends its call with
UNIMPLEMENTED. An exception out of a handler ends its call with INTERNAL, no other.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol
from urllib.parse import quote

log = logging.getLogger(__name__)


class Status(IntEnum):
    """The gRPC status codes the services end calls with."""

    OK = 0
    INVALID_ARGUMENT = 3
    NOT_FOUND = 5
    RESOURCE_EXHAUSTED = 8
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14


class CallHandler(Protocol):
    """One call's service side, made by its method's factory when the call opens."""

    def message(self, data: bytes) -> None:
        """A whole message of the call (serialized)."""

    def half_closed(self) -> None:
        """The client has sent all its messages."""

    def cancelled(self) -> None:
        """The client reset the call, or its connection ended: nothing more is sent."""

    def overflow(self) -> None:
        """A message on its way would take the process's room past its limit: the
        handler answers as it must (the call is ended with RESOURCE_EXHAUSTED after it,
        unless it ended the call itself); the message's bytes are dropped."""


class Room(Protocol):
    """Bytes the process may hold of requests, shared by the transport and the services."""

    def take(self, size: int) -> bool: ...

    def give(self, size: int) -> None: ...


@dataclass(frozen=True, slots=True)
class Limits:
    max_message: int
    """One message's size, at most."""
    room: Room


class Sender(Protocol):
    """What carries a call's answers (`grpc_h2`'s connection)."""

    def send(self, call: Call, frame: bytes) -> None: ...

    def end(self, call: Call, trailers: list[tuple[bytes, bytes]]) -> None: ...


Method = Callable[["Call"], CallHandler]
_UNQUOTED = " !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~"
"""Printable ASCII but `%`: what gRPC sends of `grpc-message` as it is."""


class Call:
    """One gRPC call: its method, the verbs its handler answers with (`write`, `finish`),
    and what its carrier keeps of it (`started`, `pending`, `trailers`)."""

    __slots__ = (
        "_buffer",
        "_limits",
        "_reserved",
        "_sender",
        "done",
        "handler",
        "method",
        "pending",
        "started",
        "stream_id",
        "trailers",
    )

    def __init__(self, sender: Sender, stream_id: int, method: str, limits: Limits) -> None:
        self._sender = sender
        self._limits = limits
        self.stream_id = stream_id
        self.method = method
        self.handler: CallHandler | None = None
        self.done = False
        """Ended (by the handler, the transport or the client): nothing more is sent."""
        self._buffer = bytearray()
        """The start of a message still arriving."""
        self._reserved = 0
        """What the message still arriving holds of the room."""
        self.started = False
        """The response's headers are sent."""
        self.pending: list[bytes] = []
        """Data flow control holds back."""
        self.trailers: list[tuple[bytes, bytes]] | None = None
        """The status, sent once `pending` is."""

    def write(self, message: bytes) -> None:
        """Send one serialized message (nothing once the call is done)."""
        if not self.done:
            self._sender.send(self, b"\0" + len(message).to_bytes(4, "big") + message)

    def finish(self, status: Status = Status.OK, details: str = "") -> None:
        """End the call with `status` (and `details`, the error's message)."""
        if self.done:
            return
        self.done = True
        self.forget()
        trailers = [(b"grpc-status", b"%d" % status)]
        if details:
            trailers.append((b"grpc-message", quote(details, safe=_UNQUOTED).encode()))
        self._sender.end(self, trailers)

    def received(self, data: bytes) -> None:
        """Bytes of the call's messages, as they came."""
        if self.done:
            return
        buffer = self._buffer
        if not buffer and len(data) >= 5 and data[0] == 0:
            size = int.from_bytes(data[1:5], "big")
            if len(data) == 5 + size and size <= self._limits.max_message:
                self._run(self._deliver, data[5:])  # the common case: one message, whole
                return
        buffer += data
        limits = self._limits
        while len(buffer) >= 5 and not self.done:
            if buffer[0] != 0:
                self.finish(Status.UNIMPLEMENTED, "compressed messages are not accepted")
                return
            size = int.from_bytes(buffer[1:5], "big")
            if size > limits.max_message:
                over = f"a message of {size} bytes is over the limit of {limits.max_message}"
                self.finish(Status.RESOURCE_EXHAUSTED, over)
                return
            if len(buffer) < 5 + size:
                if not self._reserved:
                    if not limits.room.take(size):
                        self._buffer = bytearray()
                        self._run(self._overflow)
                        self.finish(Status.RESOURCE_EXHAUSTED, "the server holds too much")
                        return
                    self._reserved = size
                return
            message = bytes(buffer[5 : 5 + size])
            del buffer[: 5 + size]
            self._give_back()
            self._run(self._deliver, message)

    def half_closed(self) -> None:
        """The client sent its last message."""
        if not self.done:
            self._run(self._half_closed)

    def cancel(self) -> None:
        """The client reset the call or went: it is done, its handler told."""
        self.forget()
        self.pending.clear()
        if not self.done:
            self.done = True
            self._run(self._cancelled)

    def forget(self) -> None:
        """The message in progress no longer holds any room."""
        self._give_back()
        self._buffer = bytearray()

    def _give_back(self) -> None:
        if self._reserved:
            self._limits.room.give(self._reserved)
            self._reserved = 0

    def _deliver(self, message: bytes) -> None:
        if self.handler is not None:
            self.handler.message(message)

    def _half_closed(self) -> None:
        if self.handler is not None:
            self.handler.half_closed()

    def _cancelled(self) -> None:
        if self.handler is not None:
            self.handler.cancelled()

    def _overflow(self) -> None:
        if self.handler is not None:
            self.handler.overflow()

    def _run(self, step: Callable[..., None], *args: bytes) -> None:
        """`step` of the handler; what it raises ends this call, not the connection."""
        try:
            step(*args)
        except Exception:
            log.exception("gRPC method %s failed", self.method)
            self.finish(Status.INTERNAL, "the service failed")
