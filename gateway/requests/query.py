"""What choosing reads of one request: `RouteQuery`, the same for all its attempts.

The prompt tokens (None when the gateway could not tokenize), the text (cache_aware's key
when there are no tokens), the index's answer (None when there was no index, no tokens,
or the index failed), `pending` (per worker, the leading blocks of the prompt this gateway
sent it that the index may not show yet: `gateway.load.pending`), `now` (simulated or
monotonic seconds) for policies that age state, the session and the prefill the request
names, the prefills flow control released it for; and for the router, which candidates
may serve it: the kind of pair, the namespace (model, adapters) and the batch. What
changes per attempt (the workers to avoid) or per entry point (the endpoints a picker may
choose among) is an argument of the router's methods, never a field. The policies
(`gateway.policies.base`), the router, flow control's headroom and the simulators read it
alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from gateway.load.pending import PendingHit
from gateway.requests.namespace import BASE, RequestNamespace
from gateway.settings.base import Kind
from globalkv.lookup import LookupResult

_NOTHING_PENDING: Mapping[str, PendingHit] = MappingProxyType({})
"""A query's `pending` when nothing sent is unsettled: shared, read-only."""


# Built several times per request (copied with each choice's pending blocks), so not
# frozen (a frozen dataclass sets each field through object.__setattr__) and with its own
# __init__, compiled where the module is (the dataclass gives eq and repr only; its
# generated __init__ runs interpreted): docs/gateway-design.md. Once read, only the way in
# (`gateway.serving.intake`) writes it: the index's answer (`Router.look_up`), the prefills
# flow control released it for.
@dataclass(slots=True, init=False)
class RouteQuery:
    tokens: Sequence[int] | None
    text: str | None
    lookup: LookupResult | None
    now: float
    pending: Mapping[str, PendingHit]
    """Worker id -> leading prompt blocks sent to it and not yet settled (index blocks)."""
    prefill: str | None
    """The prefill (worker id) that whoever routed the request named for it, as an endpoint
    picker names it to a decode's sidecar: the chooser prefers it while it is eligible."""
    within: frozenset[str] | None
    """The prefills flow control released the request for (`gateway.flow.headroom`): its
    first token predicted within its objective there, the headroom above it kept. The
    router chooses among those while any of them may serve it; None: any."""
    session: str | None
    """The conversation the client named (`gateway.policies.sessions`), if any."""
    missing: str | None
    """Why there are no tokens (no_tokenizer, not_tokenizable): the fallback counted."""
    namespace: RequestNamespace
    """Where the prompt's KV is cached: the lookup's namespace; its model and adapters
    restrict the candidates."""
    kind: Kind | None
    """The PD protocol the pair must speak (SGLang's `/generate`: sglang), or any."""
    batch: int | None
    """Elements of a batch request (one room each); None for a single request."""

    def __init__(
        self,
        tokens: Sequence[int] | None,
        text: str | None = None,
        lookup: LookupResult | None = None,
        now: float = 0.0,
        pending: Mapping[str, PendingHit] = _NOTHING_PENDING,
        prefill: str | None = None,
        within: frozenset[str] | None = None,
        session: str | None = None,
        missing: str | None = None,
        namespace: RequestNamespace = BASE,
        kind: Kind | None = None,
        batch: int | None = None,
    ) -> None:
        self.tokens = tokens
        self.text = text
        self.lookup = lookup
        self.now = now
        self.pending = pending
        self.prefill = prefill
        self.within = within
        self.session = session
        self.missing = missing
        self.namespace = namespace
        self.kind = kind
        self.batch = batch

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
