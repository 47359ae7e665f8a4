"""The body limit and the client-disconnect race, driven by ASGI messages directly."""

from __future__ import annotations

import asyncio

import pytest
from starlette.responses import PlainTextResponse
from starlette.types import Message, Receive, Scope, Send

from kvplumbing.asgi import (
    BodyLimit,
    BodyTooLarge,
    ClientGone,
    read_body,
    receive_body,
    unless_client_leaves,
)


def _scope(*headers: tuple[bytes, bytes]) -> Scope:
    return {"type": "http", "method": "POST", "path": "/p", "headers": list(headers)}


def _receiving(*messages: Message) -> tuple[Receive, list[Message]]:
    """A receive giving `messages` in order, then waiting; the list shows what is left."""
    queue = list(messages)

    async def receive() -> Message:
        if queue:
            return queue.pop(0)
        await asyncio.Event().wait()  # a client with nothing more to say
        raise AssertionError("an Event nobody sets was set")

    return receive, queue


def _part(body: bytes, more: bool) -> Message:
    return {"type": "http.request", "body": body, "more_body": more}


DISCONNECT: Message = {"type": "http.disconnect"}


async def test_a_body_within_the_limit_is_read_whole() -> None:
    receive, _ = _receiving(_part(b"ab", True), _part(b"cd", False))
    assert await read_body(_scope(), receive, 4) == b"abcd"


async def test_an_announced_oversized_body_is_refused_unread() -> None:
    receive, left = _receiving(_part(b"abcde", False))
    with pytest.raises(BodyTooLarge, match="larger than 4 bytes"):
        await receive_body(_scope((b"content-length", b"5")), receive, 4)
    assert len(left) == 1


async def test_a_streamed_body_is_refused_at_the_part_that_passes_the_limit() -> None:
    receive, left = _receiving(_part(b"abc", True), _part(b"de", True), _part(b"f", False))
    with pytest.raises(BodyTooLarge):
        await receive_body(_scope((b"content-length", b"3")), receive, 4)  # it lied
    assert left == [_part(b"f", False)]


async def test_a_client_leaving_mid_body_is_client_gone() -> None:
    receive, _ = _receiving(_part(b"ab", True), DISCONNECT)
    assert await receive_body(_scope(), receive, 4) == [_part(b"ab", True), DISCONNECT]
    receive, _ = _receiving(_part(b"ab", True), DISCONNECT)
    with pytest.raises(ClientGone):
        await read_body(_scope(), receive, 4)


class _Recorder:
    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.received: list[bytes] = []

    async def send(self, message: Message) -> None:
        self.sent.append(message)

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            self.received.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        await PlainTextResponse("ok")(scope, receive, send)


async def test_body_limit_hands_a_small_body_on_and_refuses_a_large_one() -> None:
    inner = _Recorder()
    limited = BodyLimit(
        inner.app, limit=4, refuse=lambda path: PlainTextResponse(f"{path} too big", 413)
    )
    receive, _ = _receiving(_part(b"ab", True), _part(b"cd", False))
    await limited(_scope(), receive, inner.send)
    assert inner.received == [b"ab", b"cd"]
    assert inner.sent[0]["status"] == 200

    refused = _Recorder()
    receive, _ = _receiving(_part(b"abcde", False))
    await limited(_scope(), receive, refused.send)
    assert refused.sent[0]["status"] == 413
    assert refused.sent[1]["body"] == b"/p too big"
    assert inner.received == [b"ab", b"cd"], "the app never saw the large body"


class _Parked:
    """Work that waits until cancelled, and a client that leaves when told."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()
        self._leave = asyncio.Event()

    async def receive(self) -> Message:
        await self._leave.wait()
        return DISCONNECT

    async def leave(self) -> None:
        await self.started.wait()
        self._leave.set()

    async def work(self, *, on_cancel: str | None = None) -> str:
        """Parks; cancelled, it re-raises, or returns `on_cancel` (its last step done)."""
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            if on_cancel is None:
                raise
            return on_cancel
        raise AssertionError("an Event nobody sets was set")


async def test_work_that_finishes_first_gives_its_result() -> None:
    receive, _ = _receiving()

    async def work() -> int:
        return 7

    assert await unless_client_leaves(receive, work()) == 7


async def test_a_client_leaving_cancels_the_work() -> None:
    parked = _Parked()
    race = asyncio.ensure_future(unless_client_leaves(parked.receive, parked.work()))
    await parked.leave()
    with pytest.raises(ClientGone):
        await race
    assert parked.cancelled.is_set()


async def test_a_result_reached_despite_the_cancellation_is_abandoned() -> None:
    parked = _Parked()
    abandoned: list[str] = []

    async def abandon(outcome: str) -> None:
        abandoned.append(outcome)

    work = parked.work(on_cancel="stream")
    race = asyncio.ensure_future(unless_client_leaves(parked.receive, work, abandon=abandon))
    await parked.leave()
    with pytest.raises(ClientGone):
        await race
    assert abandoned == ["stream"]


async def test_cancelling_the_caller_cancels_the_work() -> None:
    parked = _Parked()
    race = asyncio.ensure_future(unless_client_leaves(parked.receive, parked.work()))
    await parked.started.wait()
    race.cancel()
    with pytest.raises(asyncio.CancelledError):
        await race
    assert parked.cancelled.is_set()


async def test_work_failing_as_it_is_cancelled_is_logged_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    parked = _Parked()

    async def work() -> str:
        try:
            return await parked.work()
        except asyncio.CancelledError:
            raise OSError("upstream reset while closing") from None

    race = asyncio.ensure_future(unless_client_leaves(parked.receive, work()))
    await parked.leave()
    with pytest.raises(ClientGone):
        await race
    assert "work failed after its client left: OSError('upstream reset while closing')" in (
        caplog.text
    )
