"""Where a KV-event batch enters ingest: decoded and translated once, here.

Past the subscribers and the replay client everything sees `Received`: a source's seq
with its index events, never the engine's bytes or shapes, so a batch is decoded in one
place whichever socket it came by, and what the engine said is interpreted only by
`translate`. A payload that does not decode still takes its seq (`Received.batch` is
the `WireError`): the source's writer counts the drop and moves on, where a missing seq
would be a gap to replay.
"""

from __future__ import annotations

from dataclasses import dataclass

from globalkv.metrics import IngestMetrics
from globalkv.translate import Translated, translate
from globalkv.wire import EventBatch, WireError, decode_batch


@dataclass(frozen=True, slots=True)
class Received:
    """One publisher batch of one source, live or replayed."""

    seq: int
    at: float
    """time.monotonic() on arrival, for the apply-lag histogram."""
    batch: Translated | WireError
    """Its index events, or why its payload was not a batch."""


def receive(seq: int, payload: bytes, model: str, at: float, metrics: IngestMetrics) -> Received:
    """The batch `payload` of a source serving `model`, decoded and translated."""
    try:
        batch = decode_batch(payload)
    except WireError as exc:
        return Received(seq, at, exc)
    return received(seq, batch, model, at, metrics)


def received(
    seq: int, batch: EventBatch, model: str, at: float, metrics: IngestMetrics
) -> Received:
    """A batch decoded already (the bound socket reads its DP rank first), translated."""
    translated = translate(batch, model)
    for reason, count in translated.skipped.items():
        metrics.skipped.labels(reason).inc(count)
    return Received(seq, at, translated)
