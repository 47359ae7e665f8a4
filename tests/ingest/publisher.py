"""A scriptable KV-event publisher for ingest tests, in process or as a child process.

It publishes with `globalkv.wire`'s encoders exactly as an engine would (PUB + a replay
ROUTER with a bounded buffer), and can misbehave on purpose: skip sending a batch live
(a gap the replay can fill), forget its buffer (a gap it cannot), restart its seq at 0,
and send raw garbage frames. It uses XPUB so a test can wait until the subscriber's
subscription has arrived instead of sleeping.

Child process: `python -m tests.ingest.publisher --control tcp://127.0.0.1:P --endpoint …`;
commands are JSON objects on a REP socket (see `Control`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import deque
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.asyncio

from globalkv.keys import EngineHash
from globalkv.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    Flavor,
    Frame,
    ReplayLayout,
    WireError,
    encode_batch,
    live_frames,
    parse_replay_request,
    replay_end,
    replay_reply,
)


def event_from_json(raw: dict[str, Any]) -> Event:
    kind = raw["type"]
    if kind == "BlockStored":
        return BlockStored(
            block_hashes=[EngineHash(h) for h in raw["block_hashes"]],
            parent_block_hash=raw.get("parent"),
            token_ids=raw["token_ids"],
            block_size=raw["block_size"],
            medium=raw.get("medium", "GPU"),
            lora_name=raw.get("lora_name"),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(
            block_hashes=[EngineHash(h) for h in raw["block_hashes"]],
            medium=raw.get("medium", "GPU"),
        )
    return AllBlocksCleared()


class Publisher:
    def __init__(
        self,
        context: zmq.asyncio.Context,
        *,
        endpoint: str,
        connect: bool = False,
        replay_endpoint: str | None = None,
        topic: str = "",
        flavor: Flavor = "vllm",
        layout: ReplayLayout = "topic",
        buffer_steps: int = 10_000,
    ) -> None:
        self.topic = topic.encode()
        self.flavor: Flavor = flavor
        self.layout: ReplayLayout = layout
        self.seq = 0
        self.buffer: deque[Frame] = deque(maxlen=buffer_steps)
        self.pub = context.socket(zmq.XPUB)
        self.pub.linger = 0
        self.pub.sndhwm = 1_000_000
        if connect:
            self.pub.connect(endpoint)
        else:
            self.pub.bind(endpoint)
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.router: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            self.router = context.socket(zmq.ROUTER)
            self.router.linger = 0
            self.router.bind(replay_endpoint)
            self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay_task: asyncio.Task[None] | None = None
        self.replay_open = asyncio.Event()
        self.replay_open.set()

    def start(self) -> None:
        if self.router is not None:
            self._replay_task = asyncio.create_task(self._serve_replay())

    async def wait_subscribed(self, timeout: float = 10.0) -> None:
        """Return once a subscriber's subscription message reached us."""
        async with asyncio.timeout(timeout):
            while True:
                message = await self.pub.recv()
                if message[:1] == b"\x01":
                    return

    async def publish(
        self, events: Sequence[Event], *, dp_rank: int | None = 0, send: bool = True
    ) -> int:
        """Publish one batch (or only buffer it for replay with `send=False`); its seq."""
        batch = EventBatch(ts=1.0 + self.seq, events=list(events), dp_rank=dp_rank)
        frame = Frame(self.topic, self.seq, encode_batch(batch, self.flavor))
        self.buffer.append(frame)
        if send:
            await self.pub.send_multipart(live_frames(frame.topic, frame.seq, frame.payload))
        self.seq += 1
        return frame.seq

    async def raw(self, frames: Sequence[bytes]) -> None:
        await self.pub.send_multipart(list(frames))

    def restart(self) -> None:
        """As a restarted engine: seq from 0, nothing buffered."""
        self.seq = 0
        self.buffer.clear()

    def trim(self, keep: int) -> None:
        """Forget all but the last `keep` buffered batches."""
        while len(self.buffer) > keep:
            self.buffer.popleft()

    async def _serve_replay(self) -> None:
        assert self.router is not None
        while True:
            identity, *request = await self.router.recv_multipart()
            await self.replay_open.wait()
            try:
                start = parse_replay_request(request)
            except WireError:
                continue
            for frame in list(self.buffer):
                if frame.seq >= start:
                    await self.router.send_multipart([identity, *replay_reply(frame, self.layout)])
            await self.router.send_multipart([identity, *replay_end(self.layout)])

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            await asyncio.gather(self._replay_task, return_exceptions=True)
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)


class Control:
    """JSON commands for a child-process publisher:
    {"op": "publish", "events": [...], "dp_rank": 0, "send": true} → {"seq": n}
    {"op": "restart"} · {"op": "trim", "keep": n} · {"op": "raw", "frames": ["hex", …]}
    {"op": "hold_replay"} / {"op": "release_replay"}: answer replay requests only once released
    {"op": "wait_subscribed"} · {"op": "info"} → endpoints · {"op": "stop"}"""

    def __init__(self, publisher: Publisher) -> None:
        self.publisher = publisher

    async def handle(self, command: dict[str, Any]) -> dict[str, Any]:
        op = command["op"]
        pub = self.publisher
        if op == "publish":
            events = [event_from_json(e) for e in command["events"]]
            seq = await pub.publish(
                events, dp_rank=command.get("dp_rank", 0), send=command.get("send", True)
            )
            return {"seq": seq}
        if op == "restart":
            pub.restart()
        elif op == "trim":
            pub.trim(command["keep"])
        elif op == "raw":
            await pub.raw([bytes.fromhex(f) for f in command["frames"]])
        elif op == "hold_replay":
            pub.replay_open.clear()
        elif op == "release_replay":
            pub.replay_open.set()
        elif op == "wait_subscribed":
            await pub.wait_subscribed()
        elif op == "info":
            return {"endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint}
        elif op != "stop":
            return {"error": f"unknown op {op!r}"}
        return {"ok": True}


async def serve(args: argparse.Namespace) -> None:
    context = zmq.asyncio.Context()
    publisher = Publisher(
        context,
        endpoint=args.endpoint,
        connect=args.connect,
        replay_endpoint=args.replay_endpoint,
        topic=args.topic,
        flavor=args.flavor,
        layout=args.layout,
        buffer_steps=args.buffer_steps,
    )
    publisher.start()
    control = Control(publisher)
    rep = context.socket(zmq.REP)
    rep.linger = 0
    rep.connect(args.control)
    try:
        while True:
            command = json.loads(await rep.recv())
            await rep.send(json.dumps(await control.handle(command)).encode())
            if command["op"] == "stop":
                return
    finally:
        rep.close(linger=0)
        await publisher.close()
        context.term()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--control", required=True, help="the driver's bound REQ socket, connected to"
    )
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--connect", action="store_true", help="connect the PUB (bind mode)")
    parser.add_argument("--replay-endpoint")
    parser.add_argument("--topic", default="")
    parser.add_argument("--flavor", default="vllm", choices=["vllm", "vllm-array", "sglang"])
    parser.add_argument("--layout", default="topic", choices=["seq", "topic"])
    parser.add_argument("--buffer-steps", type=int, default=10_000)
    asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
