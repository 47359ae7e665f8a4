"""Fault injection: the failures a control plane must survive, on demand and repeatable.

Each draw is independent, from one seeded generator per engine, and counted in
`globalkv_engine_faults_injected_total{kind}` so a test or a demo can tell injected
failures from real ones.
"""

from __future__ import annotations

import random

from enginesim.config import FaultSettings
from enginesim.handshake import MAX_ROOM
from enginesim.metrics import EngineMetrics


class Faults:
    def __init__(self, settings: FaultSettings, metrics: EngineMetrics) -> None:
        self.settings = settings
        self._metrics = metrics
        self._rng = random.Random(settings.seed)

    def _draw(self, rate: float, kind: str) -> bool:
        if rate <= 0.0 or self._rng.random() >= rate:
            return False
        self._metrics.faults.labels(kind).inc()
        return True

    def fail_request(self) -> bool:
        return self._draw(self.settings.fail_rate, "fail_request")

    def prefill_eos(self) -> bool:
        return self._draw(self.settings.eos_rate, "eos")

    def drop_event_batch(self) -> bool:
        return self._draw(self.settings.drop_event_rate, "drop_event")

    def metadata_room(self, room: int) -> int:
        """The room the prefill writes into the KV metadata: the real one, 0 or another."""
        if self._draw(self.settings.unready_room_rate, "unready_room"):
            return 0
        if self._draw(self.settings.wrong_room_rate, "wrong_room"):
            return room % MAX_ROOM + 1
        return room
