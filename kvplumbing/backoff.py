"""Capped exponential backoff as a pure calculator, apart from the loops that wait.

Each caller keeps its own schedule (SGLang's registration retries, the gateway's
sglang-router retry rules, an indexer waiting for its index) but they share one formula,
so a delay means the same thing everywhere. The random draw that jitters a delay is the
caller's argument: a test replays a schedule exactly by passing the draws.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Backoff:
    """min(base × multiplier^n, cap) after failed try n, times a jitter factor in [low, high).

    `jitter` is (low, high): (1, 1) for none, (0.75, 1) for SGLang's "down by up to 25 %",
    (0.8, 1.2) for sglang-router's "± 20 %". Units are the caller's (seconds everywhere in
    globalkv).
    """

    base: float
    cap: float
    multiplier: float = 2.0
    jitter: tuple[float, float] = (1.0, 1.0)

    def __post_init__(self) -> None:
        low, high = self.jitter
        if self.base < 0 or self.cap < 0:
            raise ValueError("backoff base and cap must not be negative")
        if self.multiplier < 1:
            raise ValueError("backoff multiplier must be at least 1")
        if not 0 <= low <= high:
            raise ValueError(f"backoff jitter {self.jitter} must satisfy 0 <= low <= high")

    @classmethod
    def spread(cls, base: float, cap: float, multiplier: float, spread: float) -> Backoff:
        """Jittered by ± `spread` (a fraction of the delay)."""
        return cls(base, cap, multiplier, (max(0.0, 1.0 - spread), 1.0 + spread))

    def delay(self, attempt: int, draw: float = 0.0) -> float:
        """The pause after failed try `attempt` (0-based); `draw` in [0, 1) picks the jitter."""
        try:
            grown = self.base * self.multiplier**attempt
        except OverflowError:  # a float power past 1e308: long past any cap
            grown = self.cap
        low, high = self.jitter
        return min(grown, self.cap) * (low + (high - low) * draw)
