"""Reading a SUB: a queue that never empties must not keep the event loop from others."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from globalkv.ingest.subscribers import DRAIN_BURST, drain


async def test_drain_lets_the_loop_run_while_messages_stay_queued(
    context: zmq.asyncio.Context,
) -> None:
    total = DRAIN_BURST * 8
    pull = context.socket(zmq.PULL)
    push = context.socket(zmq.PUSH)
    pull.linger = push.linger = 0
    pull.rcvhwm = push.sndhwm = 0
    pull.bind("inproc://drain-burst")
    push.connect("inproc://drain-burst")
    sync_push: zmq.Socket[bytes] = zmq.Socket.shadow(push.underlying)
    for n in range(total):
        sync_push.send(n.to_bytes(4, "big"))  # all queued before the reader starts
    read = 0
    seen: list[int] = []

    async def reader() -> None:
        nonlocal read
        async for _ in drain(pull):
            read += 1
            if read == total:
                return

    async def other() -> None:
        while read < total:
            seen.append(read)
            await asyncio.sleep(0)

    try:
        async with asyncio.timeout(10):
            await asyncio.gather(reader(), other())
    finally:
        pull.close(linger=0)
        push.close(linger=0)
    between = [n for n in seen if 0 < n < total]
    assert between, f"the loop ran only before and after the {total} queued messages: {seen}"
    assert max(b - a for a, b in zip([0, *between], [*between, total], strict=True)) <= (
        DRAIN_BURST
    )
