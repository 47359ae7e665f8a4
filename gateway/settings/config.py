"""The gateway's one typed configuration, built from flags in `gateway.settings.flags` only.

Defaults are sglang-router 0.3.2's where it has the setting (`docs/protocols.md` §6), so a user
moving from it keeps the behaviour they know.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from pydantic import BaseModel, Field, field_validator, model_validator

from gateway.settings.base import PolicyName, frozen
from gateway.settings.edge import AdmissionConfig, EdgeConfig
from gateway.settings.flow import FlowConfig
from gateway.settings.routing import CacheAwareConfig, PdDeciderConfig, PrefixWeights
from gateway.settings.workers import (
    BreakerConfig,
    DiscoveryConfig,
    HealthConfig,
    RetryConfig,
    WorkerSpec,
)
from kvplumbing.addresses import check_http_url
from kvplumbing.auth import ProtectedMode, ProtectionFlags
from kvplumbing.budget import BodyBudget, default_total

DEFAULT_TRACES_ENDPOINT = "http://localhost:4318/v1/traces"
"""Where `--enable-trace` alone sends spans: a local OpenTelemetry collector's OTLP/HTTP
receiver (sglang-router's default, localhost:4317, is OTLP over gRPC)."""


ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
"""OpenTelemetry's own variables naming where traces go, the more specific first."""


def configured_endpoint(
    flag: str | None,
    environ: Mapping[str, str] = os.environ,
    default: str | None = None,
) -> str | None:
    """Where traces go: the flag, else OpenTelemetry's variables, else `default` (what
    `--enable-trace` asks for); None: tracing off."""
    if flag:
        return flag
    found = (environ[name] for name in ENDPOINT_VARIABLES if environ.get(name))
    return next(found, default)


class GatewayConfig(BaseModel):
    model_config = frozen()

    host: str = Field("0.0.0.0", description="Address the gateway listens on.")
    port: int = Field(30000, ge=1, le=65535, description="Port the gateway listens on.")
    prometheus_host: str = Field("0.0.0.0", description="Address of the metrics listener.")
    prometheus_port: int | None = Field(
        29000, ge=1, le=65535, description="Separate metrics port (also at /metrics); None = off."
    )
    prefill: list[WorkerSpec] = Field(default_factory=list, description="Prefill workers.")
    decode: list[WorkerSpec] = Field(default_factory=list, description="Decode workers.")
    prefill_policy: PolicyName = Field("prefix", description="How a prefill is chosen.")
    decode_policy: PolicyName = Field("power_of_two", description="How a decode is chosen.")
    prefix: PrefixWeights = Field(default_factory=PrefixWeights)
    cache_aware: CacheAwareConfig = Field(default_factory=CacheAwareConfig)
    pd_decider: PdDeciderConfig = Field(default_factory=PdDeciderConfig)
    retry: RetryConfig = Field(default_factory=RetryConfig)
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    api_key: str | None = Field(None, description="Bearer key required on inference endpoints.")
    admin_token: str | None = Field(
        None,
        min_length=1,
        repr=False,
        description="Bearer token for /workers mutations (else the API key); without either, "
        "only loopback clients may change the workers.",
    )
    insecure: bool = Field(
        False,
        description="Without an admin token or API key, let any host add and remove workers.",
    )
    request_timeout_secs: float = Field(
        1800,
        gt=0,
        description="Deadline of one request, all attempts included, until its answer (a "
        "stream: its first byte), answered 504 with the PD stage it stopped in; also the "
        "longest silence of one upstream call.",
    )
    max_payload_size: int = Field(512 * 1024 * 1024, ge=1, description="Request body limit.")
    max_buffered_payload_size: int | None = Field(
        None,
        ge=1,
        description="Request-body bytes the process holds at once, all requests together "
        "(taken as bodies arrive, given back when each request ends or its client leaves); "
        "a body that does not fit is answered 503. Its last eighth is kept for bodies of at "
        "most a thousandth of it. None: twice --max-payload-size, at least 256 MiB.",
    )
    enable_trace: bool = Field(
        False,
        description="Export the gateway's request spans even with no endpoint given: to "
        f"OpenTelemetry's variables, else {DEFAULT_TRACES_ENDPOINT}. Needs globalkv[otel].",
    )
    otlp_traces_endpoint: str | None = Field(
        None,
        description="OTLP/HTTP URL the gateway's request spans are exported to (e.g. "
        "http://collector:4318/v1/traces); without it, OpenTelemetry's "
        "OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; with neither, "
        "no spans (a client's traceparent is still passed on). Needs globalkv[otel].",
    )
    max_client_connections: int | None = Field(
        None,
        ge=1,
        description="Client connections open at once; past it a new one takes the place of "
        "the connection idle longest, or is answered 503 and closed when none is idle. "
        "None: half the open-files limit, the rest left for connections to the workers.",
    )
    redis_url: str | None = Field(None, description="Read index and pod registry from Redis.")
    redis_prefix: str = Field(
        "gkv", min_length=1, description="Key prefix of the index and registry in Redis."
    )
    indexer_url: str | None = Field(None, description="Ask the indexer's HTTP API instead.")
    share_state_interval_secs: float | None = Field(
        None,
        gt=0,
        le=60,
        allow_inf_nan=False,
        description="With --redis-url: share each prefill's load and the prompts sent but "
        "not yet indexed with the other gateways on that Redis, every this many seconds "
        "(what the others see is about two intervals old at most); unset: not shared.",
    )
    indexer_token: str | None = Field(
        None,
        min_length=1,
        repr=False,
        description="The indexer's admin token, sent when registering pods and with lookups.",
    )
    model: str | None = Field(
        None,
        description="Model name keyed in the index; default: the request's model when a "
        "prefill serves it, else the first prefill's served name.",
    )
    tokenizer: str | None = Field(
        None, description="tokenizer.json, a model directory, or 'byte'; None = no tokenizer."
    )
    block_size: int | None = Field(
        None, ge=1, description="Index block size (required with --redis-url)."
    )
    lookup_timeout_secs: float = Field(0.5, gt=0, description="Timeout of one index lookup.")
    seed: int | None = Field(None, description="Seed of the routing RNG (rooms stay random).")
    # Kubernetes-native settings (their models above).
    discovery: DiscoveryConfig = Field(default_factory=DiscoveryConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    flow: FlowConfig = Field(default_factory=FlowConfig)
    edge: EdgeConfig = Field(default_factory=EdgeConfig)
    vllm_allow_recompute: bool = Field(
        False,
        description="vLLM PD: when every prefill attempt failed, send the decode the request "
        "without kv_transfer_params (it computes the prompt itself) instead of failing.",
    )

    @property
    def traces_endpoint(self) -> str | None:
        """Where the request spans go, as `otlp_traces_endpoint` and `enable_trace` say
        with OpenTelemetry's variables; None: no spans."""
        default = DEFAULT_TRACES_ENDPOINT if self.enable_trace else None
        return configured_endpoint(self.otlp_traces_endpoint, default=default)

    @property
    def body_budget(self) -> int:
        """The total of `max_buffered_payload_size`, its default resolved."""
        if self.max_buffered_payload_size is None:
            return default_total(self.max_payload_size)
        return self.max_buffered_payload_size

    def protected_mode(self) -> ProtectedMode:
        """Who may change the workers; sglang-router's API key guards them when no admin
        token is given, as it guards everything there."""
        if self.admin_token is None and self.api_key is not None:
            flags = ProtectionFlags("gateway", token="--api-key")
            return ProtectedMode("the gateway", self.api_key, self.insecure, flags)
        flags = ProtectionFlags("gateway")
        return ProtectedMode("the gateway", self.admin_token, self.insecure, flags)

    @field_validator("indexer_url")
    @classmethod
    def _indexer_url(cls, value: str | None) -> str | None:
        return None if value is None else check_http_url(value)

    @model_validator(mode="after")
    def _consistent(self) -> GatewayConfig:
        if self.decode_policy == "prefix":
            raise ValueError("the prefix policy reads prefill caches; choose another for decode")
        if self.redis_url and self.indexer_url:
            raise ValueError("give --redis-url or --indexer-url, not both")
        if self.redis_url and self.block_size is None:
            raise ValueError("--redis-url needs --block-size (the index block size)")
        largest = BodyBudget(self.body_budget).largest
        if largest < self.max_payload_size:
            raise ValueError(
                f"--max-buffered-payload-size {self.body_budget} holds a body of at most "
                f"{largest} bytes (an eighth is kept for small ones), less than "
                f"--max-payload-size {self.max_payload_size}: give at least "
                f"{-(-self.max_payload_size * 8 // 7)}"
            )
        if self.share_state_interval_secs is not None and not self.redis_url:
            raise ValueError("--share-state-interval-secs shares through Redis: give --redis-url")
        for spec in self.prefill:
            if spec.role != "prefill":
                raise ValueError(f"{spec.url} is listed as prefill but has role {spec.role}")
        for spec in self.decode:
            if spec.role != "decode":
                raise ValueError(f"{spec.url} is listed as decode but has role {spec.role}")
        urls = [s.url for s in (*self.prefill, *self.decode)]
        duplicates = sorted({u for u in urls if urls.count(u) > 1})
        if duplicates:
            raise ValueError(f"workers listed twice: {', '.join(duplicates)}")
        return self
