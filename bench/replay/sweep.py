"""`--sweep NAME=V1,V2,…`: the parameters a replay may vary, and how a value is applied.

Kept apart from the runner so that the command line can name them without importing the
simulation (and numpy with it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.replay.config import ReplaySettings
from gateway.settings.base import optional_float


@dataclass(frozen=True, slots=True)
class Sweepable:
    """A parameter `--sweep` may vary: where it lives and how a value is read."""

    section: str
    """"cluster", "prefix", "cache_aware" or "" (a top-level replay setting)."""
    field: str
    parse: Callable[[str], object]
    overrides: str | None = None
    """A field that would take precedence over this one, cleared while sweeping."""


SWEEPABLE: dict[str, Sweepable] = {
    "event-delay-s": Sweepable("cluster", "event_delay_s", float),
    "capacity-blocks": Sweepable("cluster", "capacity_blocks", int),
    "capacity-fraction": Sweepable("cluster", "capacity_fraction", float, "capacity_blocks"),
    "utilisation": Sweepable("cluster", "utilisation", float, "prefill_tokens_per_s"),
    "prefill-tokens-per-s": Sweepable("cluster", "prefill_tokens_per_s", float),
    "attention-tokens": Sweepable("cluster", "attention_tokens", optional_float),
    "pods": Sweepable("cluster", "pods", int),
    "prefix-uncached-weight": Sweepable("prefix", "uncached_weight", float),
    "prefix-queued-weight": Sweepable("prefix", "queued_weight", float),
    "prefix-request-cost": Sweepable("prefix", "request_cost", float),
    "prefix-pressure-weight": Sweepable("prefix", "pressure_weight", float),
    "prefix-pending-grace-secs": Sweepable("prefix", "pending_grace_secs", optional_float),
    "session-ttl-secs": Sweepable("prefix", "session_ttl_secs", optional_float),
    "cache-threshold": Sweepable("cache_aware", "cache_threshold", float),
    "balance-abs-threshold": Sweepable("cache_aware", "balance_abs_threshold", int),
    "arrivals": Sweepable("", "arrivals", str),
    "gateways": Sweepable("", "gateways", int),
    "gateway-sharing": Sweepable("", "gateway_sharing", str),
    "pd-decider": Sweepable("", "pd_decider", str),
    "pd-decider-itl-weight": Sweepable("", "pd_decider_itl_weight", float),
}


@dataclass(frozen=True, slots=True)
class Sweep:
    parameter: str
    values: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> Sweep:
        name, sep, values = text.partition("=")
        if not sep or name not in SWEEPABLE:
            raise ValueError(
                f"--sweep {text!r}: expected NAME=V1,V2,… with NAME one of "
                + ", ".join(sorted(SWEEPABLE))
            )
        items = tuple(v.strip() for v in values.split(",") if v.strip())
        if not items:
            raise ValueError(f"--sweep {text!r} gives no values")
        return cls(name, items)

    def apply(self, settings: ReplaySettings, value: str) -> ReplaySettings:
        """The settings with this value; pydantic validates it like a flag."""
        spec = SWEEPABLE[self.parameter]
        try:
            parsed = spec.parse(value)
        except ValueError:
            raise ValueError(f"--sweep {self.parameter}: {value!r} is not a valid value") from None
        data: dict[str, Any] = settings.model_dump()
        target = data[spec.section] if spec.section else data
        target[spec.field] = parsed
        if spec.overrides is not None:
            target[spec.overrides] = None
        return ReplaySettings.model_validate(data)
