"""The event loop's longest pause while the largest allowed batches arrive on a bound SUB.

    python -m bench.ingest_stall [--batches 3] [--runs 5]

An in-process ingest with the memory index takes `--batches` batches of 65,536 stores (one
16-token block each, ~7 MB) on its bound socket; a probe task that yields at every turn of
the loop records the longest gap between two of its turns, in wall time and in the loop
thread's CPU time (which other processes loading the machine do not inflate), with
Python's garbage collector on and off. Medians over `--runs`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time
from collections.abc import Sequence

import msgpack
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from globalkv.index.base import Source
from globalkv.index.memory import MemoryIndex
from globalkv.ingest.config import IngestConfig
from globalkv.ingest.service import IngestService
from globalkv.metrics import IngestMetrics
from globalkv.registry import MemoryRegistry
from globalkv.wire import live_frames
from globalkv.wire.decode import MAX_BATCH_EVENTS


def heavy_batch(first: int = 0) -> bytes:
    """The largest batch allowed: 65,536 stores of one 16-token block each (~7 MB)."""
    events = [
        ["BlockStored", [first + i + 1], None, list(range(i * 16, i * 16 + 16)), 16, None, "GPU"]
        for i in range(MAX_BATCH_EVENTS)
    ]
    return msgpack.packb([1.0, events, 0])


async def longest_stall(
    context: zmq.asyncio.Context, payload: bytes, batches: int
) -> tuple[float, float]:
    """(wall, loop-thread CPU) seconds of the longest gap between two turns of the loop.

    The batches are sent from another thread, as from another process: the loop runs only
    the service (and the probe), so every stall measured is the service's."""
    service = IngestService(
        MemoryIndex(16),
        MemoryRegistry(),
        IngestMetrics(CollectorRegistry()),
        IngestConfig(bind=["tcp://127.0.0.1:0"]),
        context=context,
    )
    await service.start()
    gc.collect()
    gc.freeze()  # as the indexer does once started: full collections walk only what is new
    wall = cpu = 0.0
    woke = (time.perf_counter(), time.thread_time())

    def turn() -> None:
        nonlocal wall, cpu, woke
        now = (time.perf_counter(), time.thread_time())
        wall, cpu = max(wall, now[0] - woke[0]), max(cpu, now[1] - woke[1])
        woke = now

    async def probe() -> None:
        while True:
            await asyncio.sleep(0)
            turn()

    def publish() -> None:
        with zmq.Context() as own, own.socket(zmq.XPUB) as pub:
            pub.connect(service.bound.endpoints[0])
            pub.recv()  # the SUB subscribed
            for seq in range(batches):
                pub.send_multipart(live_frames(b"kv@p@m", seq, payload))
            pub.close(linger=10_000)

    probing = asyncio.create_task(probe())
    try:
        await asyncio.sleep(0)
        turn()  # the gap before the probe first ran is the bench's, not the service's
        wall = cpu = 0.0
        sending = asyncio.get_running_loop().run_in_executor(None, publish)
        source = Source("p")

        def all_received(_: object) -> bool:
            worker = service.followed.worker(source)
            return worker is not None and worker.received == batches

        await service.followed.wait(source, all_received, timeout=300)
        await service.followed.flush()  # each applied, or dropped past the queue's bound
        turn()  # a stall up to now
        await sending
    finally:
        probing.cancel()
        await service.stop()
    return wall, cpu


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ingest_stall", description=__doc__)
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    context = zmq.asyncio.Context()
    payload = heavy_batch()
    results: dict[str, list[tuple[float, float]]] = {"collector on": [], "collector off": []}
    for _ in range(args.runs):
        for label in results:  # interleaved, so load from other processes hits both alike
            (gc.enable if label == "collector on" else gc.disable)()
            results[label].append(asyncio.run(longest_stall(context, payload, args.batches)))
    gc.enable()
    context.term()
    print(f"{args.batches} batches of {MAX_BATCH_EVENTS:,} events, medians of {args.runs} runs")
    print("| garbage collector | longest stall, wall | longest stall, loop-thread CPU |")
    print("|---|---|---|")
    for label, runs in results.items():
        wall = statistics.median(w for w, _ in runs) * 1000
        cpu = statistics.median(c for _, c in runs) * 1000
        print(f"| {label} | {wall:.0f} ms | {cpu:.0f} ms |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
