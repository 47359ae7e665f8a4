"""Which flow a request joins: its tenant (the fairness id) and its objective (priority and
time to first token), read from its headers as llm-d and the Gateway API Inference
Extension read them.

- Tenant: the first of the fairness headers present (llm-d's, then GIE's, by default);
  without one, the LoRA adapter the request names (a tenant's fine-tune is the usual unit
  of billing), else its API key, kept only as a digest (a key is a secret; its digest
  still tells tenants apart), else `default-flow`, llm-d's default. An id is at most
  `MAX_TENANT_BYTES` of visible ASCII: a longer one, or one with other bytes, is the
  client's 400 (the id is kept in memory, shared through Redis and shown in logs).
- Objective: the first objective header present names a configured objective; an
  unknown name gets the `default` objective (priority 0 when none is configured), as
  llm-d's picker treats an InferenceObjective it does not find, and is counted. A value
  that cannot name one (not a DNS subdomain) is a 400.
- A time to first token of the request's own (llm-d's `x-llm-d-slo-ttft-ms`, its older
  `x-slo-ttft-ms`): a positive number of milliseconds, at most an hour, else a 400. It
  can only hold the request back (it is released when its first token is predicted
  within it), never put it ahead, so the client may set it.

Clients can name any tenant and objective: where they must not, the edge in front of
the gateway sets these headers (as llm-d's AuthPolicy templates do) and drops the
clients' own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from gateway.requests.bodies import BadRequest
from gateway.settings.flow import (
    DEFAULT_OBJECTIVE,
    DEFAULT_TTFT_HEADERS,
    MAX_TTFT_MS,
    FlowConfig,
    Objective,
    objective_name,
)

DEFAULT_TENANT = "default-flow"
MAX_TENANT_BYTES = 256
_VISIBLE = frozenset(range(0x21, 0x7F))


@dataclass(frozen=True, slots=True)
class FlowKey:
    """A request's flow and what it is held to."""

    tenant: str
    priority: int
    objective: str
    """The objective it was given: a configured name, or `default`."""
    ttft_s: float | None
    """Release it only when its first token is predicted within this (its own, else its
    objective's)."""


class FlowKeys:
    def __init__(self, config: FlowConfig) -> None:
        self._fairness = tuple(h.encode() for h in config.fairness_headers)
        self._objective = tuple(h.encode() for h in config.objective_headers)
        self._ttft = tuple(h.encode() for h in DEFAULT_TTFT_HEADERS)
        self.objectives = {o.name: o for o in config.objectives}
        self.default = self.objectives.get(DEFAULT_OBJECTIVE) or Objective(name=DEFAULT_OBJECTIVE)
        self.header_names = frozenset((*self._fairness, *self._objective, *self._ttft))
        """The request headers read here (the gateway picks them in its one pass)."""
        self.unknown = 0
        """Requests that named an objective not configured (given the default)."""

    def read(
        self, headers: Mapping[bytes, bytes], adapter: str | None, authorization: str | None
    ) -> FlowKey:
        """The flow of a request with these (picked, lower-case) headers; `BadRequest` for
        a header that cannot be read."""
        objective = self._objective_of(headers)
        ttft_s = self._ttft_of(headers)
        if ttft_s is None:
            ttft_s = objective.ttft_s
        tenant = self._tenant_of(headers, adapter, authorization)
        return FlowKey(tenant, objective.priority, objective.name, ttft_s)

    def _tenant_of(
        self, headers: Mapping[bytes, bytes], adapter: str | None, authorization: str | None
    ) -> str:
        for name in self._fairness:
            value = headers.get(name)
            if not value:
                continue
            if len(value) > MAX_TENANT_BYTES:
                raise BadRequest(f"{name.decode()} is longer than {MAX_TENANT_BYTES} bytes")
            if not _VISIBLE.issuperset(value):
                raise BadRequest(f"{name.decode()} must be visible ASCII characters only")
            return value.decode("ascii")
        if adapter is not None:
            return f"lora:{adapter}"[:MAX_TENANT_BYTES]
        if authorization:
            digest = hashlib.blake2b(authorization.encode("utf-8", "replace"), digest_size=8)
            return f"key:{digest.hexdigest()}"
        return DEFAULT_TENANT

    def _objective_of(self, headers: Mapping[bytes, bytes]) -> Objective:
        for name in self._objective:
            value = headers.get(name)
            if not value:
                continue
            text = value.decode("latin-1").strip()
            found = self.objectives.get(text)
            if found is not None:
                return found
            if not objective_name(text):
                raise BadRequest(
                    f"{name.decode()} must name an InferenceObjective, got {text[:80]!r}"
                )
            self.unknown += 1
            return self.default
        return self.default

    def _ttft_of(self, headers: Mapping[bytes, bytes]) -> float | None:
        for name in self._ttft:
            value = headers.get(name)
            if value is None:
                continue
            try:
                ms = float(value)
            except ValueError:
                ms = -1.0
            if not 0 < ms <= MAX_TTFT_MS:  # NaN fails too
                raise BadRequest(
                    f"{name.decode()} must be milliseconds above 0 and at most {MAX_TTFT_MS:g}"
                )
            return ms / 1000
        return None
