"""The components' HTTP answers as the stack reads them: only the fields it uses.

Readiness checks and `doctor` read other processes' JSON, possibly of another version,
so these models ignore unknown fields and give every field a default: an answer that
changed shape shows up as a missing value in a report, never as a crash. A body that is
not JSON of the expected outline raises `ValueError` (pydantic's `ValidationError`).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class WorkerView(_Lenient):
    """One entry of the gateway's `GET /workers`."""

    id: str
    url: str
    role: str
    kind: str = "sglang"
    """The PD protocol it speaks: sglang or vllm."""
    eligible: bool = False
    health: str = "unknown"
    health_error: str | None = None
    circuit: str = "unknown"
    consecutive_failures: int = 0
    in_flight: int = 0
    pod: str | None = None
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    directory: str | None = None
    directory_port: int | None = None
    directory_error: str | None = None
    registered_pod: str | None = None
    served_model: str | None = None
    last_error: str | None = None
    """The latest discovery, pod-registration or request failure the gateway saw."""
    last_error_age_secs: float | None = None
    last_error_step: str | None = None
    """Which step that failure was: "call", "discovery" or "registration"."""
    discovered: bool = False
    """What the worker advertises was read, and is asked no more: with a discovery error,
    it answered with nothing usable."""


class WorkersView(_Lenient):
    workers: list[WorkerView] = Field(default_factory=list)


class PdDeciderView(_Lenient):
    """The gateway's `pd_decider` settings: whether each request is disaggregated."""

    mode: str = "always"
    transfer_tokens_per_s: float | None = None
    itl_weight: float | None = None


class GatewaySettingsView(_Lenient):
    """The gateway's `GET /v1/config`: the settings routing uses."""

    prefill_policy: str = "unknown"
    index: str | None = None
    """indexer, redis, or None."""
    indexer_url: str | None = None
    redis_url: str | None = None
    lookup_timeout_secs: float | None = None
    model_in_use: str | None = None
    tokenizer: str | None = None
    tokenizer_loaded: bool = False
    pd_decider: PdDeciderView | None = None
    """None: a gateway that always disaggregates and does not say so."""


class SourceView(_Lenient):
    """One (pod, DP rank) event source in the indexer's `GET /v1/pods`."""

    dp_rank: int = 0
    last_seq: int | None = None
    last_event_ts: float | None = None
    last_applied_at: float | None = None
    applied: int = 0
    resets: int = 0
    drops: int = 0
    queue_depth: int = 0


class PodStateView(_Lenient):
    subscribed: bool = False
    resyncing: bool = False
    sources: list[SourceView] = Field(default_factory=list)
    updated_at: float | None = None


class PodView(_Lenient):
    id: str
    model: str = ""
    block_size: int | None = None
    url: str | None = None
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    dp_size: int = 1
    state: PodStateView | None = None


class PodsView(_Lenient):
    pods: list[PodView] = Field(default_factory=list)


class DirectoryView(_Lenient):
    """globalkv's own `GET /v1/directory` on a bootstrap server."""

    ready: bool = False
    registered: int = 0
    expected: int | None = None
