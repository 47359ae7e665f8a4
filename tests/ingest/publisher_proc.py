"""Drive `tests.ingest.publisher` running in another process, over its control socket."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.asyncio

from tests.support.procs import Proc


def chain(
    tokens: Sequence[int], block_size: int, *, first_hash: int, parent: int | None = None
) -> dict[str, Any]:
    """A BlockStored (JSON form) for whole blocks of `tokens`, hashes first_hash, +1, …"""
    blocks = len(tokens) // block_size
    return {
        "type": "BlockStored",
        "block_hashes": list(range(first_hash, first_hash + blocks)),
        "parent": parent,
        "token_ids": list(tokens[: blocks * block_size]),
        "block_size": block_size,
    }


class PublisherProc:
    """A publisher child process; build it with `await PublisherProc.start(context, …)`.

    Nothing here picks a port for the child to bind: a port picked and released can be
    taken (by any ephemeral connect) before the child binds it. The driver binds the
    control socket on a port the kernel gives it and the child connects to it; the child
    binds its PUB and replay sockets on port 0 and `start` asks it what it got.
    """

    def __init__(
        self,
        context: zmq.asyncio.Context,
        *,
        flavor: str = "vllm",
        layout: str = "topic",
        topic: str = "",
        connect_to: str | None = None,
        replay: bool = True,
        buffer_steps: int = 10_000,
        dp_rank: int = 0,
        name: str = "publisher",
    ) -> None:
        self.req = context.socket(zmq.REQ)
        self.req.linger = 0
        self.control = f"tcp://127.0.0.1:{self.req.bind_to_random_port('tcp://127.0.0.1')}"
        self.endpoint = connect_to or "tcp://127.0.0.1:0"
        self.replay_endpoint: str | None = "tcp://127.0.0.1:0" if replay else None
        argv = [
            sys.executable,
            "-m",
            "tests.ingest.publisher",
            "--control",
            self.control,
            "--endpoint",
            self.endpoint,
            "--flavor",
            flavor,
            "--layout",
            layout,
            "--topic",
            topic,
            "--buffer-steps",
            str(buffer_steps),
            "--dp-rank",
            str(dp_rank),
        ]
        if connect_to is not None:
            argv.append("--connect")
        if self.replay_endpoint is not None:
            argv += ["--replay-endpoint", self.replay_endpoint]
        self.proc = Proc(argv, name=name)

    @classmethod
    async def start(cls, context: zmq.asyncio.Context, **options: Any) -> PublisherProc:
        """Spawn the child and learn the endpoints it bound; stops it if it never says."""
        publisher = cls(context, **options)
        try:
            info = await publisher.call(op="info")
        except BaseException:
            publisher.stop()
            raise
        publisher.endpoint = info["endpoint"]
        publisher.replay_endpoint = info["replay_endpoint"]
        return publisher

    async def call(self, timeout: float = 15.0, **command: Any) -> dict[str, Any]:
        try:
            # Until the child has connected, a REQ has no peer to send to.
            await asyncio.wait_for(self.req.send(json.dumps(command).encode()), timeout)
        except TimeoutError:
            raise TimeoutError(
                f"publisher never connected for {command['op']}:\n{self.proc.log()}"
            ) from None
        if not await self.req.poll(int(timeout * 1000)):
            raise TimeoutError(f"publisher did not answer {command['op']}:\n{self.proc.log()}")
        reply: dict[str, Any] = json.loads(await self.req.recv())
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    async def publish(self, *events: dict[str, Any], send: bool = True) -> int:
        reply = await self.call(op="publish", events=list(events), send=send)
        seq: int = reply["seq"]
        return seq

    async def raw(self, *frames: bytes) -> None:
        await self.call(op="raw", frames=[f.hex() for f in frames])

    def stop(self) -> None:
        self.req.close(linger=0)
        self.proc.stop()
