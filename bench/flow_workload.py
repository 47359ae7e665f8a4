"""The tenants of `bench.flow`, each a slice of a Mooncake-format trace.

Each tenant gets its own window of consecutive trace requests, the windows one after the
other from an offset the seed picks (wrapping around the trace when it runs out). A
window keeps what the trace says of each request: its arrival pattern (rounded
timestamps spread, `bench.replay.trace.arrival_times`), its input length and its hash
ids, so turns of one conversation share their prefix and the prefix cache sees the
trace's reuse. What changes is the clock: a window is stretched or compressed in time so
that its prompt tokens arrive at the tenant's share of the cluster's capacity,

    capacity = prefills × prefill tokens per s      (uncached prompt tokens per second),

and it is as long as that rate over the run needs. Hash ids are moved into a namespace
per tenant (and per pass over the trace), so tenants share no prefix: each is its own
application with its own system prompt, and the noisy tenant's cache hits cannot help
anyone else.

The same requests, at the same times, are replayed in every run: a tenant alone, under
FIFO admission and under flow control, so its requests can be compared one by one.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from bench.replay.trace import Trace, arrival_times


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    share: float
    """Prompt tokens offered per second, a multiple of the capacity."""
    objective: str | None = None
    """The objective its requests name (`x-llm-d-inference-objective`); None: the default."""


@dataclass(frozen=True, slots=True)
class Planned:
    tenant: str
    index: int
    """Its position in the tenant's slice: the same request in every run."""
    at: float
    """Seconds from the run's start."""
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Slice:
    tenant: Tenant
    requests: tuple[Planned, ...]
    first: int
    """Trace position of its first request (before wrapping)."""
    stretch: float
    """Run seconds per trace second."""

    @property
    def tokens(self) -> int:
        return sum(r.input_length for r in self.requests)


def _namespace(trace: Trace) -> int:
    """A power of two above every hash id of the trace: ids + k × it never meet."""
    top = max(max(r.hash_ids) for r in trace.requests)
    return 1 << top.bit_length()


def _count(trace: Trace, start: int, tokens: float) -> int:
    """How many consecutive requests from `start` (wrapping) carry `tokens`."""
    n = len(trace.requests)
    count = total = 0
    while total < tokens:
        total += trace.requests[(start + count) % n].input_length
        count += 1
    return count


def _clock(trace: Trace) -> tuple[list[float], float]:
    """Each request's trace seconds (equal timestamps spread) and the length of one pass:
    a later pass starts one mean gap after the trace's last request."""
    spread = arrival_times(trace.requests, "spread")
    gap = (spread[-1] - spread[0]) / max(len(spread) - 1, 1)
    return spread, spread[-1] + gap


def slice_tenants(
    trace: Trace,
    tenants: Sequence[Tenant],
    capacity_tokens_per_s: float,
    seconds: float,
    seed: int,
) -> list[Slice]:
    """Each tenant's window, in order, its arrivals over `seconds` at its share."""
    n = len(trace.requests)
    space = _namespace(trace)
    spread, period = _clock(trace)

    def stamp(position: int) -> float:
        return (position // n) * period + spread[position % n]

    position = random.Random(seed).randrange(n)
    slices: list[Slice] = []
    for number, tenant in enumerate(tenants):
        count = _count(trace, position, tenant.share * capacity_tokens_per_s * seconds)
        origin = stamp(position)
        span = stamp(position + count) - origin  # to the arrival after the window
        stretch = seconds / span if span > 0 else 1.0
        requests = []
        for index in range(count):
            at = position + index
            req = trace.requests[at % n]
            shift = space * (1 + number + len(tenants) * (at // n))
            requests.append(
                Planned(
                    tenant=tenant.name,
                    index=index,
                    at=(stamp(at) - origin) * stretch,
                    input_length=req.input_length,
                    output_length=req.output_length,
                    hash_ids=tuple(shift + i for i in req.hash_ids),
                )
            )
        slices.append(Slice(tenant, tuple(requests), position % n, stretch))
        position += count
    return slices
