"""The engine emulator's KV-event publisher, driven by the ingest tests, in process or as a
child process.

`Publisher` is `enginesim.publisher.KVEventPublisher` (the one publisher with replay) with
the tests' defaults: the PUB binds unless told to connect, the replay layout is chosen
apart from the flavour, a batch's time is 1 + its seq (+ 1000 per restart), and `send` /
`raw` return once the batch is on the socket. Its misbehaviours are the emulator's: a
batch only buffered (a gap the replay can fill), a buffer that forgot (a gap it cannot), a
restart, garbage frames, replies held back.

Child process: `python -m tests.ingest.publisher --control tcp://127.0.0.1:P --endpoint …`;
commands are JSON objects on a REP socket (see `Control`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from enginesim.metrics import EngineMetrics
from enginesim.publisher import KVEventPublisher, PublisherSettings
from globalkv.keys import EngineHash
from globalkv.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    Flavor,
    ReplayLayout,
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


class Publisher(KVEventPublisher):
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
        dp_rank: int = 0,
    ) -> None:
        settings = PublisherSettings(
            endpoint,
            replay_endpoint,
            topic,
            flavor,
            dp_rank,
            buffer_steps,
            hwm=1_000_000,
            layout=layout,
            bind=not connect,
        )
        self.restarts = 0
        self.registry = CollectorRegistry()
        super().__init__(
            settings,
            context,
            EngineMetrics(self.registry),
            clock=lambda: 1.0 + self.next_seq + 1000.0 * self.restarts,
        )

    def restart(self) -> None:
        """A restarted engine's clock runs on: its batches are newer than any before."""
        super().restart()
        self.restarts += 1

    @property
    def endpoint(self) -> str:
        return self.bound_endpoint or self.settings.endpoint

    def replays_served(self) -> float:
        """Replay requests answered so far (the indexer's catch-up is the first)."""
        served = self.registry.get_sample_value(
            "globalkv_engine_kv_replay_requests_total", {"dp_rank": self._rank, "outcome": "served"}
        )
        return served or 0.0

    async def send(self, events: Sequence[Event], *, live: bool = True) -> int:
        """Publish one batch (`live` False: only buffer it for replay); its seq, once sent."""
        seq = self.publish(events, live=live)
        assert seq is not None, "an empty batch is not published"
        await self.drain()
        return seq

    async def raw(self, frames: Sequence[bytes]) -> None:
        self.send_raw(frames)
        await self.drain()


class Control:
    """JSON commands for a child-process publisher:
    {"op": "publish", "events": [...], "send": true} → {"seq": n}
    {"op": "restart"} · {"op": "trim", "keep": n} · {"op": "raw", "frames": ["hex", …]}
    {"op": "hold_replay"} / {"op": "release_replay"}: answer replay requests only once released
    {"op": "wait_subscribed"} · {"op": "replays_served"} → {"served": n}
    {"op": "info"} → endpoints · {"op": "stop"}"""

    def __init__(self, publisher: Publisher) -> None:
        self.publisher = publisher

    async def handle(self, command: dict[str, Any]) -> dict[str, Any]:
        op = command["op"]
        pub = self.publisher
        if op == "publish":
            events = [event_from_json(e) for e in command["events"]]
            seq = await pub.send(events, live=command.get("send", True))
            return {"seq": seq}
        if op == "restart":
            pub.restart()
        elif op == "trim":
            pub.forget(command["keep"])
        elif op == "raw":
            await pub.raw([bytes.fromhex(f) for f in command["frames"]])
        elif op == "hold_replay":
            pub.replay_open.clear()
        elif op == "release_replay":
            pub.replay_open.set()
        elif op == "wait_subscribed":
            await pub.wait_subscribed()
        elif op == "replays_served":
            return {"served": pub.replays_served()}
        elif op == "info":
            return {"endpoint": pub.endpoint, "replay_endpoint": pub.bound_replay_endpoint}
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
        dp_rank=args.dp_rank,
    )
    await publisher.start()
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
        await publisher.stop()
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
    parser.add_argument("--dp-rank", type=int, default=0, help="the DP rank in every batch")
    asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
