"""Large batches on the bound socket do not stall the event loop: decoding, translating and
applying (memory index) run in slices with the loop's turn between them. The bound is the
fix's contract, kept generous for a loaded 2-core machine (a slice is ~15 ms on one idle
core; before the fix one 65,536-event batch held the loop for over a second)."""

from __future__ import annotations

import asyncio
import time

import msgpack
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

STALL_BOUND = 2.5
"""Seconds the loop may go without a turn: a guard against the per-batch stalls coming
back (5.9 s for these three batches before the fix), not the 100 ms target. Slices are
~15 ms; what remains is not sliced yet (0.25-1.7 s measured here, varying with the load:
Python's full garbage collection over the events in flight, and freeing a group of them
at once), reported in `docs/benchmarks.md`."""


def heavy_batch(first: int) -> bytes:
    """The largest batch allowed: 65,536 stores of one 16-token block each (~7 MB)."""
    events = [
        ["BlockStored", [first + i + 1], None, list(range(i * 16, i * 16 + 16)), 16, None, "GPU"]
        for i in range(MAX_BATCH_EVENTS)
    ]
    return msgpack.packb([1.0, events, 0])


async def test_heavy_batches_do_not_stall_the_event_loop(context: zmq.asyncio.Context) -> None:
    config = IngestConfig(bind=["tcp://127.0.0.1:0"])
    service = IngestService(
        MemoryIndex(16),
        MemoryRegistry(),
        IngestMetrics(CollectorRegistry()),
        config,
        context=context,
    )
    await service.start()
    pub = context.socket(zmq.XPUB)
    pub.connect(service.bound.endpoints[0])
    await pub.recv()  # the SUB subscribed
    longest, woke = 0.0, time.perf_counter()

    async def probe() -> None:
        nonlocal longest, woke
        while True:
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            longest, woke = max(longest, now - woke - 0.005), now

    payload = heavy_batch(0)
    probing = asyncio.create_task(probe())
    try:
        for seq in range(3):
            await pub.send_multipart(live_frames(b"kv@p@m", seq, payload))
        await service.followed.applied(Source("p"), 2, timeout=120)
        longest = max(longest, time.perf_counter() - woke - 0.005)  # a stall up to now
    finally:
        probing.cancel()
        pub.close(linger=0)
        await service.stop()
    assert longest < STALL_BOUND, f"the event loop stalled for {longest * 1000:.0f} ms"
