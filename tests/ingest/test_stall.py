"""Large batches on the bound socket do not stall the event loop: decoding, translating and
applying (memory index) run in slices with the loop's turn between them, and what a
source may queue is bounded in events. The bound is the fix's contract, on the loop
thread's CPU time so that a loaded machine cannot fail it."""

from __future__ import annotations

import zmq.asyncio

from bench.ingest_stall import heavy_batch, longest_stall

STALL_BOUND = 1.0
"""Seconds of the loop thread's CPU time between two of its turns: a guard against the
per-batch stalls coming back (one 65,536-event batch held the loop for well over a second
before decoding, translating and applying were sliced), ten times what remains (its
figures, with their command, are in `docs/benchmarks.md`)."""


async def test_heavy_batches_do_not_stall_the_event_loop(context: zmq.asyncio.Context) -> None:
    _, longest = await longest_stall(context, heavy_batch(), batches=5)
    assert longest < STALL_BOUND, f"the event loop stalled for {longest * 1000:.0f} ms"
