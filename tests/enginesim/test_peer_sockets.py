from __future__ import annotations

import gc

import pytest
import zmq
import zmq.asyncio

from enginesim.peer_sockets import PushPool, bind_pull


async def test_frames_to_one_peer_arrive_in_order(context: zmq.asyncio.Context) -> None:
    inbox, port = bind_pull(context, "127.0.0.1")
    pool = PushPool(context, timeout=5.0)
    try:
        for frame in (b"one", b"two"):
            await pool.send("127.0.0.1", port, [frame])
        assert [await inbox.recv_multipart() for _ in range(2)] == [[b"one"], [b"two"]]
    finally:
        pool.close()
        inbox.close()


async def test_an_address_zmq_cannot_dial_is_refused_without_leaking_a_socket(
    context: zmq.asyncio.Context,
) -> None:
    pool = PushPool(context, timeout=1.0)
    try:
        with pytest.raises(zmq.ZMQError, match="Invalid argument"):
            await pool.send("not a host!", 5555, [b"x"])
        gc.collect()  # an unclosed socket warns when collected; warnings are errors here
    finally:
        pool.close()
