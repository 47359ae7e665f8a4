"""The decode's sidecar chooses only the prefill: the decode is the engine beside it.

`SidecarChooser` is the dispatcher's `Chooser` for `globalkv sidecar`, so the sidecar runs
the gateway's legs (SGLang's bootstrap binding, vLLM's `kv_transfer_params`), retries,
deadline and breakers unchanged, on pairs whose decode is always the local engine:

- the prefill named by whoever routed the request (`x-globalkv-prefill`, else llm-d's
  `x-prefiller-host-port`, as `host:port`) while it is in the pool and eligible: the
  prefill policy confirms it alone, so its hit, DP rank and load are counted as the
  gateway counts them;
- otherwise (no header, a prefill the sidecar does not know, or one that failed this
  request) the router's prefill policy over the whole pool, reading the index itself.

The decode is the local one whatever failed before: a sidecar has no other.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence

from gateway.policies.base import NoCandidates, RouteQuery
from gateway.requests.bodies import BadRequest
from gateway.routing.plan import RoutePlan
from gateway.routing.router import Router

log = logging.getLogger(__name__)
PREFILL_HEADER = "x-globalkv-prefill"
"""globalkv's header naming the prefill (`host:port`) the sidecar binds the request to."""
LLMD_PREFILL_HEADER = "x-prefiller-host-port"
"""llm-d's header for the same, so either project's sidecar serves behind either picker."""
_HEADERS = (PREFILL_HEADER.encode(), LLMD_PREFILL_HEADER.encode())


def named_prefill(headers: Sequence[tuple[bytes, bytes]]) -> str | None:
    """The prefill's worker id (`host:port`) that the request's headers name, ours first;
    `BadRequest` when the header is not `host:port`."""
    found = dict(headers)
    for name in _HEADERS:
        value = found.get(name)
        if value is not None:
            return _host_port(name.decode(), value.decode("latin-1").strip())
    return None


def _host_port(name: str, value: str) -> str:
    host, sep, port = value.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if (
        not sep
        or not host
        or not port.isdigit()
        or not 0 < int(port) < 65536
        or (":" in host and not bracketed)
        or any(c in host for c in "/@?# ")
    ):
        raise BadRequest(f"{name} must be host:port, got {value[:100]!r}")
    return f"{host}:{int(port)}"


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
