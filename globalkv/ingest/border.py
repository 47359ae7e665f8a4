"""Where a KV-event batch enters ingest: decoded and translated once, here.

Past the subscribers and the replay client everything sees `Received`: a source's seq
with its index events, never the engine's bytes or shapes, so a batch is decoded in one
place whichever socket it came by, and what the engine said is interpreted only by
`translate`. A payload that does not decode still takes its seq (`Received.batch` is
the `WireError`): the source's writer counts the drop and moves on, where a missing seq
would be a gap to replay.

A batch may hold 65,536 events, a second or two of decoding and translating: both run
in slices with the event loop's turn between them (`decode`, `received`), so one large
batch never stalls the API and the other sources for more than a slice.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from globalkv.metrics import IngestMetrics
from globalkv.translate import Translated, translate
from globalkv.wire import EventBatch, WireError
from globalkv.wire.decode import SLICE_EVENTS, decode_steps


@dataclass(frozen=True, slots=True)
class Received:
    """One publisher batch of one source, live or replayed."""

    seq: int
    at: float
    """time.monotonic() on arrival, for the apply-lag histogram."""
    batch: Translated | WireError
    """Its index events, or why its payload was not a batch."""


async def receive(
    seq: int, payload: bytes, model: str, at: float, metrics: IngestMetrics
) -> Received:
    """The batch `payload` of a source serving `model`, decoded and translated."""
    try:
        batch = await decode(payload)
    except WireError as exc:
        return Received(seq, at, exc)
    return await received(seq, batch, model, at, metrics)


async def decode(payload: bytes) -> EventBatch:
    """`wire.decode_batch`, the loop running between slices; raises `WireError`."""
    for batch in decode_steps(payload):
        if batch is not None:
            return batch
        await asyncio.sleep(0)
    raise AssertionError("decode_steps ends with the batch")


async def received(
    seq: int, batch: EventBatch, model: str, at: float, metrics: IngestMetrics
) -> Received:
    """A batch decoded already (the bound socket reads its DP rank first), translated a
    slice of events at a time."""
    events = batch.events
    translated = translate(EventBatch(batch.ts, events[:SLICE_EVENTS], batch.dp_rank), model)
    translated.skipped["not_for_index"] += batch.skipped
    for start in range(SLICE_EVENTS, len(events), SLICE_EVENTS):
        await asyncio.sleep(0)
        part = EventBatch(batch.ts, events[start : start + SLICE_EVENTS], batch.dp_rank)
        more = translate(part, model)
        translated.events.extend(more.events)
        translated.skipped.update(more.skipped)
    for reason, count in translated.skipped.items():
        if count:
            metrics.skipped.labels(reason).inc(count)
    return Received(seq, at, translated)
