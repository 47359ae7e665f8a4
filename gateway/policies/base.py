"""The policy interface: choose one worker from candidates, nothing else.

A policy never sends, sleeps, reads a clock or the network. Everything it may look at
comes in the call, so the same objects serve the live gateway and a discrete-event
simulator replaying traces against a real `MemoryIndex` in simulated time:

    policy = build_policy("prefix", Random(7), prefix=PrefixWeights())
    loads = LoadTracker(clock=lambda: sim_time)                  # the clock of `now`
    lookup = await IndexLookup(index).lookup(model, tokens)     # None if the index is down
    keys = lookup.keys if lookup is not None else ()
    request = RouteQuery(tokens=tokens, text=None, lookup=lookup, now=sim_time,
                           pending=loads.pending_blocks(keys))   # sent, not yet indexed
    choice = policy.choose(request, loads.candidates(pods))      # (worker, pod) pairs
    ticket = loads.start_prefill(choice, keys)                   # queued on its worker
    ...                                                          # simulated prefill
    loads.prefill_done(ticket)                                   # KV computed (or failed:
                                                                 # computed=False)
    ...                                                          # simulated decode
    loads.finish(ticket)

- `Candidate` is a snapshot of one eligible worker: its id, the index pod it maps to and
  its load (requests in flight, prefill tokens queued). The caller has already removed
  unhealthy, circuit-open and not-ready workers.
- `RouteQuery` (`gateway.requests.query`) is what choosing reads of one request.
- `Choice` names the worker, the DP rank the prompt's best hit is on (for DP-aware rooms),
  the hit it counted on, and `fallback` when the policy could not use what it prefers.
- Randomness comes only from the `random.Random` given at construction: a seeded one
  makes every choice reproducible. State a policy keeps (round-robin position,
  cache_aware's tree) changes only inside `choose`.
- Load changes only through the `LoadTracker`'s verbs (`start_prefill`, given the
  `Choice`, `start_decode`, `move`, `prefill_done`, `finish`: `gateway.load.tracker`),
  which the legs, the endpoint picker and the simulator call; policies read it through the
  candidates.
- A policy says what it needs: `uses_index` asks for the index's answer, so the router
  looks the prompt up only for a policy that reads it; `reads_load` asks for the
  candidates' load, which the router otherwise leaves empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.load.tracker import Candidate
from gateway.requests.query import RouteQuery


# Built several times per request, so not frozen (a frozen dataclass sets each field
# through object.__setattr__) and with its own __init__, compiled where the module is (the
# dataclass gives eq and repr only; its generated __init__ runs interpreted):
# docs/gateway-design.md. Treat it as read-only all the same.
@dataclass(slots=True, init=False)
class Choice:
    worker: str
    dp_rank: int | None
    """The DP rank holding the counted hit, when the index told us."""
    hit_tokens: int
    """Cached prompt tokens the choice expects on that worker."""
    uncached_tokens: int
    """Prompt tokens the worker will have to prefill (its queue grows by these)."""
    fallback: str | None
    """Why the policy fell back to choosing by load (no_tokens, index_unavailable)."""

    def __init__(
        self,
        worker: str,
        dp_rank: int | None = None,
        hit_tokens: int = 0,
        uncached_tokens: int = 0,
        fallback: str | None = None,
    ) -> None:
        self.worker = worker
        self.dp_rank = dp_rank
        self.hit_tokens = hit_tokens
        self.uncached_tokens = uncached_tokens
        self.fallback = fallback


class Policy(Protocol):
    name: str
    uses_index: bool
    """It reads `RouteQuery.lookup`: the prompt is looked up in the index for it."""
    reads_load: bool
    """It reads the candidates' load: without it, the router hands it candidates with
    none filled in (no load snapshot per worker per request)."""

    def choose(self, request: RouteQuery, candidates: Sequence[Candidate]) -> Choice:
        """Pick one of `candidates` (never empty)."""
        ...

    def forget(self, worker: str) -> None:
        """The worker left the pool; drop what is kept about it."""
        ...


class NoCandidates(LookupError):
    """No worker of a role may take traffic (none healthy, circuits open, not ready)."""
