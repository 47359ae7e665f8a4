"""Emulated engines as real processes, and a KV-event tap, for the integration tests.

Engines are started with ZMQ and bootstrap ports 0 and discovered through `/server_info`,
exactly as a control plane adopts them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import zmq

from globalkv.wire import EventBatch, decode_batch, parse_live, parse_replay_reply, replay_request
from tests.support.metrics import scrape
from tests.support.net import free_port
from tests.support.procs import Proc

FAST = ("--decode-tokens-per-s", "5000", "--prefill-tokens-per-s", "200000")


@dataclass
class EngineProc:
    proc: Proc
    url: str
    info: dict[str, Any]

    @property
    def bootstrap_port(self) -> int:
        return int(self.info["disaggregation_bootstrap_port"])

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        """The engine's /metrics sample (0 when the series does not exist yet)."""
        return scrape(self.url, name, **(labels or {}))

    def stop(self) -> None:
        self.proc.stop()


def start_engine(role: str, *args: str, name: str | None = None) -> EngineProc:
    port = free_port()
    argv = ["engine", "--role", role, "--port", str(port), *FAST]
    if role == "prefill":
        argv += ["--bootstrap-port", "0", "--kv-events-endpoint", "tcp://*:0"]
        argv += ["--kv-events-replay-endpoint", "tcp://*:0"]
    proc = Proc.globalkv(*argv, *args, name=name or role)
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(f"{url}/health")
        info = httpx.get(f"{url}/server_info", timeout=5).json()
    except BaseException:
        proc.stop()
        raise
    return EngineProc(proc, url, info)


@contextmanager
def engines(*specs: tuple[str, Sequence[str]]) -> Iterator[list[EngineProc]]:
    started: list[EngineProc] = []
    try:
        for role, args in specs:
            started.append(start_engine(role, *args))
        yield started
    finally:
        for engine in started:
            engine.stop()


def pd_body(prefill: EngineProc, room: int, **fields: Any) -> dict[str, Any]:
    return {
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": prefill.bootstrap_port,
        "bootstrap_room": room,
        **fields,
    }


async def pd_request(
    prefill: EngineProc, decode: EngineProc, path: str, body: dict[str, Any]
) -> tuple[httpx.Response, httpx.Response]:
    """Send the same body to both, concurrently, as a PD router does."""
    async with httpx.AsyncClient(timeout=30) as client:
        first, second = await asyncio.gather(
            client.post(f"{prefill.url}{path}", json=body),
            client.post(f"{decode.url}{path}", json=body),
        )
    return first, second


class EventTap:
    """A SUB on one DP rank's KV-event stream, plus its replay ROUTER."""

    def __init__(self, engine: EngineProc, dp_rank: int = 0) -> None:
        self.engine = engine
        self.dp_rank = dp_rank
        events = engine.info["kv_events"]
        self.topic = events["topic"].encode()
        self.endpoint = f"tcp://127.0.0.1:{events['endpoint_port_base'] + dp_rank}"
        self.replay_endpoint = f"tcp://127.0.0.1:{events['replay_endpoint_port_base'] + dp_rank}"
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.sub.connect(self.endpoint)

    def next(self, timeout: float = 10.0) -> tuple[int, EventBatch]:
        if not self.sub.poll(int(timeout * 1000)):
            raise TimeoutError(f"no KV-event batch on {self.endpoint} within {timeout}s")
        frame = parse_live(self.sub.recv_multipart())
        assert frame.topic == self.topic
        return frame.seq, decode_batch(frame.payload)

    def until_live(self, poke: Callable[[int], None], timeout: float = 20.0) -> int:
        """Poke the engine (a request) until batches arrive live, then consume every batch
        published so far; returns the last published seq.

        A SUB misses what was published before its subscription reached the PUB; after
        one batch got through, every later one does too (unless a fault drops it).
        """
        deadline = time.monotonic() + timeout
        attempt = 0
        while not self.sub.poll(200):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no live KV events on {self.endpoint}")
            poke(attempt)
            attempt += 1
        last = self.published() - 1
        seq = self.next()[0]
        while seq < last and self.sub.poll(2000):
            seq = self.next()[0]
        return last

    def published(self) -> int:
        """How many batches this DP rank has published since its (re)start."""
        info = httpx.get(f"{self.engine.url}/server_info", timeout=5).json()
        return int(info["kv_cache"][self.dp_rank]["next_event_seq"])

    def replay(self, start: int) -> list[tuple[int, EventBatch]]:
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart(replay_request(start))
        out: list[tuple[int, EventBatch]] = []
        try:
            while True:
                if not dealer.poll(10_000):
                    raise TimeoutError(f"replay from {self.replay_endpoint} stalled")
                frame = parse_replay_reply(dealer.recv_multipart())
                if frame is None:
                    return out
                out.append((frame.seq, decode_batch(frame.payload)))
        finally:
            dealer.close()

    def close(self) -> None:
        self.context.destroy(linger=0)
