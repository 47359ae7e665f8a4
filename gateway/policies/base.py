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
- `RouteQuery` is what choosing reads of one request, the same for all its attempts: the
  prompt tokens (None when the gateway could not tokenize), the text (cache_aware's key
  when there are no tokens), the index's answer (None when there was no index, no tokens,
  or the index failed), `pending` (per worker, the leading blocks of the prompt this
  gateway sent it that the index may not show yet: `gateway.load.pending`), `now`
  (simulated or monotonic seconds) for policies that age state, the session and the
  prefill the request names, the prefills flow control released it for; and for the
  router, which candidates may serve it: the kind of pair, the namespace (model,
  adapters) and the batch. What changes per attempt (the workers to avoid) or per entry
  point (the endpoints a picker may choose among) is an argument of the router's methods,
  never a field.
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
  looks the prompt up only for a policy that reads it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gateway.load.pending import PendingHit
from gateway.load.tracker import Candidate
from gateway.requests.namespace import BASE, RequestNamespace
from gateway.settings.base import Kind
from globalkv.lookup import LookupResult

# The value types below are built several times per request, so they are not frozen: a
# frozen dataclass sets each field through object.__setattr__, several times slower
# (docs/gateway-design.md). Treat them as read-only all the same.


@dataclass(slots=True)
class RouteQuery:
    tokens: Sequence[int] | None
    text: str | None = None
    lookup: LookupResult | None = None
    now: float = 0.0
    pending: Mapping[str, PendingHit] = field(default_factory=dict)
    """Worker id -> leading prompt blocks sent to it and not yet settled (index blocks)."""
    prefill: str | None = None
    """The prefill (worker id) that whoever routed the request named for it, as an endpoint
    picker names it to a decode's sidecar: the chooser prefers it while it is eligible."""
    within: frozenset[str] | None = None
    """The prefills flow control released the request for (`gateway.flow.headroom`): its
    first token predicted within its objective there, the headroom above it kept. The
    router chooses among those while any of them may serve it; None: any."""
    session: str | None = None
    """The conversation the client named (`gateway.policies.sessions`), if any."""
    missing: str | None = None
    """Why there are no tokens (no_tokenizer, not_tokenizable): the fallback counted."""
    namespace: RequestNamespace = BASE
    """Where the prompt's KV is cached: the lookup's namespace; its model and adapters
    restrict the candidates."""
    kind: Kind | None = None
    """The PD protocol the pair must speak (SGLang's `/generate`: sglang), or any."""
    batch: int | None = None
    """Elements of a batch request (one room each); None for a single request."""

    @property
    def prompt_tokens(self) -> int:
        return len(self.tokens) if self.tokens is not None else 0

    @property
    def model(self) -> str | None:
        return self.namespace.model

    @property
    def adapters(self) -> frozenset[str]:
        return self.namespace.adapters

    @property
    def keys(self) -> Sequence[int]:
        """The prompt's block keys, where the index was asked."""
        return self.lookup.keys if self.lookup is not None else ()


@dataclass(slots=True)
class Choice:
    worker: str
    dp_rank: int | None = None
    """The DP rank holding the counted hit, when the index told us."""
    hit_tokens: int = 0
    """Cached prompt tokens the choice expects on that worker."""
    uncached_tokens: int = 0
    """Prompt tokens the worker will have to prefill (its queue grows by these)."""
    fallback: str | None = None
    """Why the policy fell back to choosing by load (no_tokens, index_unavailable)."""


class Policy(Protocol):
    name: str
    uses_index: bool
    """It reads `RouteQuery.lookup`: the prompt is looked up in the index for it."""

    def choose(self, request: RouteQuery, candidates: Sequence[Candidate]) -> Choice:
        """Pick one of `candidates` (never empty)."""
        ...

    def forget(self, worker: str) -> None:
        """The worker left the pool; drop what is kept about it."""
        ...


class NoCandidates(LookupError):
    """No worker of a role may take traffic (none healthy, circuits open, not ready)."""
