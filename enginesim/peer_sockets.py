"""The ZMQ sockets both ends of the handshake use: a bound PULL inbox, and a PUSH per peer.

Peers' addresses come from the other side's messages, so a PUSH is opened on first use,
kept for the next message to the same peer (ZMQ keeps the connection and its order), and
the least recently used one is closed beyond a bound.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

import zmq
import zmq.asyncio


def bind_pull(
    context: zmq.asyncio.Context, host: str, port: int = 0
) -> tuple[zmq.asyncio.Socket, int]:
    sock = context.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://{host}:{port or '*'}")
    bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return sock, int(bound.rsplit(":", 1)[1])


class PushPool:
    """One PUSH socket per peer, the least recently used closed beyond `max_peers`."""

    def __init__(
        self, context: zmq.asyncio.Context, *, timeout: float, max_peers: int = 256
    ) -> None:
        self._ctx = context
        self._timeout = timeout
        self._max = max_peers
        self._socks: OrderedDict[tuple[str, int], zmq.asyncio.Socket] = OrderedDict()

    async def send(self, ip: str, port: int, frames: list[bytes]) -> None:
        key = (ip, port)
        sock = self._socks.pop(key, None)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 10_000)
            host = f"[{ip}]" if ":" in ip else ip
            try:
                sock.connect(f"tcp://{host}:{port}")
            except zmq.ZMQError:
                sock.close(linger=0)  # a peer's address is outside input: no socket per bad one
                raise
        self._socks[key] = sock
        while len(self._socks) > self._max:
            self._socks.popitem(last=False)[1].close(linger=0)
        # Not asyncio.wait_for: on Python 3.11 it loses a cancellation that lands as the
        # send completes, and a rank's receive loop would then outlive its engine's stop.
        async with asyncio.timeout(self._timeout):
            await sock.send_multipart(frames)

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(linger=0)
        self._socks.clear()
