"""The decode's sidecar chooses only the prefill: the decode is the engine beside it.

`SidecarChooser` is the dispatcher's `Chooser` for `globalkv sidecar`, so the sidecar runs
the gateway's legs (SGLang's bootstrap binding, vLLM's `kv_transfer_params`), retries,
deadline and breakers unchanged, on pairs whose decode is always the local engine:

- the prefill named by whoever routed the request (`x-globalkv-prefill`, else llm-d's
  `x-prefiller-host-port`, as `host:port`: `gateway.requests.headers`, read into
  `RouteQuery.prefill`) while it is in the pool and eligible: the
  prefill policy confirms it alone, so its hit, DP rank and load are counted as the
  gateway counts them;
- otherwise (no header, a prefill the sidecar does not know, or one that failed this
  request) the router's prefill policy over the whole pool, reading the index itself.

The decode is the local one whatever failed before: a sidecar has no other.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from gateway.policies.base import NoCandidates
from gateway.requests.query import RouteQuery
from gateway.routing.plan import RoutePlan
from gateway.routing.router import Router

log = logging.getLogger(__name__)


class SidecarChooser:
    def __init__(self, router: Router, decode: str) -> None:
        self._router = router
        self._decode = decode
        """The local engine's worker id."""

    def plan(self, query: RouteQuery, avoid: Collection[str] = ()) -> RoutePlan:
        router = self._router
        decode = router.pool.get(self._decode)
        if decode is None or not decode.eligible:
            raise NoCandidates(f"the local decode {self._decode} is not available")
        if query.kind is not None and query.kind != decode.kind:
            raise NoCandidates(f"the local decode speaks {decode.kind}, not {query.kind}")
        missing = set(query.adapters) - decode.adapters.keys()
        if missing:
            raise NoCandidates(f"the local decode serves no {', '.join(sorted(missing))}")
        named = query.prefill
        if named is not None and named not in avoid:
            try:
                prefill, choice, chosen = router.choose_prefill(
                    query, avoid, among=(named,), kind=decode.kind
                )
                return router.bind(chosen, prefill, choice, decode)
            except NoCandidates:
                log.debug("prefill %s named for the request is not available", named)
        prefill, choice, chosen = router.choose_prefill(query, avoid, kind=decode.kind)
        return router.bind(chosen, prefill, choice, decode)
