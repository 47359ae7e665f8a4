"""How the gateway chooses: the prefix policy's weights, cache_aware's thresholds, and
whether a request is disaggregated at all."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from gateway.settings.base import frozen


class PrefixWeights(BaseModel):
    """Weights of the prefix policy's time-to-first-token estimate (see gateway.policies.prefix)."""

    model_config = frozen()

    uncached_weight: float = Field(1.0, ge=0, description="Cost per prompt token not cached.")
    queued_weight: float = Field(0.5, ge=0, description="Cost per prefill token queued there.")
    request_cost: float = Field(
        0.0, ge=0, description="Extra cost, in tokens, per request in flight there."
    )
    pressure_weight: float = Field(
        2.0,
        ge=0,
        description="Cost per token expected evicted there and wanted again (cache pressure).",
    )
    pending_grace_secs: float | None = Field(
        2.0,
        ge=0,
        description="Count a prompt sent to a prefill as held there until this long after "
        "its prefill answered; None: only what the index shows.",
    )
    session_ttl_secs: float | None = Field(
        600.0,
        gt=0,
        description="Keep a session (X-SMG-Routing-Key or X-Dynamo-Session-ID) on its "
        "prefill until it was idle this long; None: sessions are not kept.",
    )
    sessions_max: int = Field(100_000, ge=1, description="Sessions kept, least recent dropped.")


class CacheAwareConfig(BaseModel):
    model_config = frozen()

    cache_threshold: float = Field(0.3, ge=0, le=1, description="Min match rate to follow it.")
    balance_abs_threshold: int = Field(64, ge=0, description="Imbalance: max - min load above.")
    balance_rel_threshold: float = Field(1.5, ge=1, description="Imbalance: max > min × this.")
    eviction_interval_secs: float = Field(60, gt=0, description="Tree eviction period.")
    max_tree_size: int = Field(2**26, ge=1, description="Entries kept per worker in the tree.")


PdDeciderMode = Literal["always", "local-when-faster"]


class PdDeciderConfig(BaseModel):
    """Whether each request is disaggregated (see gateway.routing.decider)."""

    model_config = frozen()

    mode: PdDeciderMode = Field(
        "always",
        description="always: every request is prefilled on a prefill worker and its KV moved "
        "to a decode; local-when-faster: a vLLM decode prefills it itself when that is "
        "estimated sooner, its running decodes' delay counted.",
    )
    transfer_tokens_per_s: float = Field(
        300_000,
        gt=0,
        description="KV moved from a prefill to a decode per second, in prompt tokens (the "
        "link's bytes/s over the model's KV bytes per token).",
    )
    itl_weight: float = Field(
        1.0,
        ge=0,
        description="Seconds of time to first token that one second of delay to one running "
        "decode on the decode worker is worth.",
    )
