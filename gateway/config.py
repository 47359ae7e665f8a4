"""The gateway's one typed configuration, built from flags in `gateway.flags` only.

Defaults are sglang-router 0.3.2's where it has the setting (`docs/protocols.md` §6), so a user
moving from it keeps the behaviour they know.
"""

from __future__ import annotations

import argparse
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gateway.flow_config import FlowConfig
from globalkv.discovery.kubernetes import parse_selector
from kvplumbing.addresses import check_http_url
from kvplumbing.auth import ProtectedMode, ProtectionFlags
from kvplumbing.budget import BodyBudget, default_total

PolicyName = Literal["prefix", "cache_aware", "power_of_two", "round_robin", "random", "least_load"]
Role = Literal["prefill", "decode"]
Kind = Literal["sglang", "vllm"]
"""The PD protocol a worker speaks: SGLang's bootstrap rooms (both legs at once) or vLLM's
`kv_transfer_params` (prefill first, then the decode with the prefill's answer)."""


def _frozen() -> ConfigDict:
    """Settings are fixed once built, unknown ones are errors, and no number is infinite
    or NaN (an infinite grace or timeout is a typo that would never end, not a choice)."""
    return ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


def optional_float(text: str) -> float | None:
    """A flag's number, or None for "none"/"off": the feature it sets is disabled."""
    if text.lower() in {"none", "off"}:
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number nor 'off'") from None


class KvEventsSpec(BaseModel):
    """Where a prefill pod publishes KV events, for the indexer to subscribe to."""

    model_config = _frozen()

    endpoint: str | None = Field(None, description="PUB endpoint, e.g. tcp://10.0.0.5:5557.")
    replay_endpoint: str | None = Field(None, description="ROUTER replay endpoint, or none.")
    topic: str = Field("", description="Topic the publisher sends (llm-d: kv@<pod>@<model>).")
    mode: Literal["connect", "bind"] = Field(
        "connect",
        description="connect: the indexer subscribes to `endpoint`; bind: the engine connects "
        "to the indexer's bound SUB and is known by its topic.",
    )


class WorkerSpec(BaseModel):
    """One worker as given on the command line or to `POST /workers`."""

    model_config = _frozen()

    url: str = Field(description="The worker's HTTP URL.")
    role: Role = Field(description="prefill or decode.")
    bootstrap_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Prefill only: the bootstrap port injected into requests; "
        "None = null, each server uses its own.",
    )
    pod_id: str | None = Field(
        None,
        min_length=1,
        description="Prefill only: the pod id the index knows it by. Default: the <pod> of "
        "its kv@<pod>@<model> topic, else the URL's host:port.",
    )
    kv_events: KvEventsSpec | None = Field(
        None, description="Prefill only: its KV-event endpoints; discovered when absent."
    )
    kind: Kind | Literal["auto"] = Field(
        "auto",
        description="sglang or vllm; auto: detected from /v1/models, /server_info, /version "
        "(SGLang until detected or when nothing tells).",
    )

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        return check_http_url(value)

    @model_validator(mode="after")
    def _decode_has_no_prefill_fields(self) -> WorkerSpec:
        if self.role == "decode" and (
            self.bootstrap_port is not None or self.pod_id is not None or self.kv_events
        ):
            raise ValueError("bootstrap_port, pod_id and kv_events apply to prefill workers only")
        return self


class RetryConfig(BaseModel):
    model_config = _frozen()

    max_retries: int = Field(5, ge=1, description="Total attempts per request, first included.")
    initial_backoff_ms: int = Field(50, ge=0, description="Delay before the second attempt.")
    max_backoff_ms: int = Field(30_000, ge=0, description="Cap on one delay.")
    backoff_multiplier: float = Field(1.5, ge=1.0, description="Growth of the delay per attempt.")
    jitter_factor: float = Field(0.2, ge=0.0, le=1.0, description="± fraction of random jitter.")
    disabled: bool = Field(False, description="One attempt only.")


class BreakerConfig(BaseModel):
    model_config = _frozen()

    failure_threshold: int = Field(10, ge=1, description="Consecutive failures that open it.")
    success_threshold: int = Field(3, ge=1, description="Half-open successes that close it.")
    timeout_duration_secs: float = Field(60, gt=0, description="How long it stays open.")
    window_duration_secs: float = Field(
        120,
        gt=0,
        description="Accepted for sglang-router compatibility; failures count "
        "consecutively, as it does.",
    )
    disabled: bool = Field(False, description="Never open.")


class HealthConfig(BaseModel):
    model_config = _frozen()

    failure_threshold: int = Field(3, ge=1, description="Consecutive failures → unhealthy.")
    success_threshold: int = Field(2, ge=1, description="Consecutive successes → healthy.")
    timeout_secs: float = Field(5, gt=0, description="Timeout of one check.")
    interval_secs: float = Field(60, gt=0, description="Time between checks of a worker.")
    startup_check_interval_secs: float = Field(
        1.0, gt=0, description="Time between checks of a worker not yet seen healthy."
    )
    endpoint: str = Field("/health", description="Path checked on the worker's HTTP URL.")
    disabled: bool = Field(False, description="Treat every worker as healthy.")
    directory_refresh_secs: float = Field(
        5.0, gt=0, description="How often each prefill's bootstrap directory is read."
    )
    registration_check_secs: float = Field(
        5.0,
        gt=0,
        description="How often the index's pods are listed, to register again a prefill it "
        "no longer lists (an indexer that keeps them in memory restarted).",
    )

    @field_validator("endpoint")
    @classmethod
    def _path(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(f"{value!r} is not a path (it must start with /)")
        return value


class PrefixWeights(BaseModel):
    """Weights of the prefix policy's time-to-first-token estimate (see gateway.policies.prefix)."""

    model_config = _frozen()

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
    model_config = _frozen()

    cache_threshold: float = Field(0.3, ge=0, le=1, description="Min match rate to follow it.")
    balance_abs_threshold: int = Field(64, ge=0, description="Imbalance: max - min load above.")
    balance_rel_threshold: float = Field(1.5, ge=1, description="Imbalance: max > min × this.")
    eviction_interval_secs: float = Field(60, gt=0, description="Tree eviction period.")
    max_tree_size: int = Field(2**26, ge=1, description="Entries kept per worker in the tree.")


PdDeciderMode = Literal["always", "local-when-faster"]


class PdDeciderConfig(BaseModel):
    """Whether each request is disaggregated (see gateway.routing.decider)."""

    model_config = _frozen()

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


# --- Kubernetes-native settings: discovery, admission, request ids, CORS, logs, DP ranks ---
# (sglang-router 0.3.2's flags of the same names; `docs/sglang-router-flags.md` compares them)

DEFAULT_REQUEST_ID_HEADERS = ("x-request-id", "x-correlation-id", "x-trace-id", "request-id")
"""sglang-router's: the request headers that carry a client's request id, first found wins."""


class DiscoveryConfig(BaseModel):
    """Workers found and followed rather than listed: Kubernetes pods by labels, or a file
    (`globalkv.discovery`), added to and removed from the pool as the source changes."""

    model_config = _frozen()

    service_discovery: bool = Field(
        False, description="Follow Kubernetes pods matching --prefill-selector/--decode-selector."
    )
    prefill_selector: list[str] = Field(
        default_factory=list, description="Labels (key=value ...) every prefill pod carries."
    )
    decode_selector: list[str] = Field(
        default_factory=list, description="Labels (key=value ...) every decode pod carries."
    )
    selector: list[str] = Field(
        default_factory=list,
        description="sglang-router's regular-mode selector: in PD mode it selects nothing, "
        "so it is accepted (and ignored) only beside a prefill or decode selector.",
    )
    port: int = Field(80, ge=1, le=65535, description="Port of a discovered pod's worker URL.")
    decode_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Port of a discovered decode pod's worker URL where it is not "
        "--service-discovery-port: the decode's sidecar, which an endpoint picker sends "
        "requests to; none: --service-discovery-port.",
    )
    namespace: str | None = Field(
        None, min_length=1, description="Namespace watched; none: every namespace."
    )
    bootstrap_port_annotation: str = Field(
        "sglang.ai/bootstrap-port",
        min_length=1,
        description="The prefill pod annotation naming its bootstrap port.",
    )
    worker_file: str | None = Field(
        None,
        min_length=1,
        description="A YAML or JSON file listing workers, read again whenever it changes.",
    )

    @field_validator("prefill_selector", "decode_selector", "selector")
    @classmethod
    def _labels(cls, items: list[str]) -> list[str]:
        """Each `key=value` item; one item may hold several, separated by commas (kubectl's
        way) or spaces (a YAML list's one string, which sglang-router splits too)."""
        pairs = [pair for item in items for pair in item.replace(",", " ").split()]
        parse_selector(pairs)
        return pairs

    @model_validator(mode="after")
    def _one_source(self) -> DiscoveryConfig:
        if self.service_discovery and self.worker_file is not None:
            raise ValueError("give --service-discovery or --worker-file, not both")
        if self.service_discovery and not (self.prefill_selector or self.decode_selector):
            which = "--selector selects nothing in PD mode; " if self.selector else ""
            raise ValueError(
                f"--service-discovery needs --prefill-selector or --decode-selector ({which}"
                "see docs/kubernetes.md)"
            )
        if not self.service_discovery and (self.prefill_selector or self.decode_selector):
            raise ValueError("label selectors are used with --service-discovery: add it")
        return self


class AdmissionConfig(BaseModel):
    """sglang-router's admission flags: at most `max_concurrent_requests` served at once,
    optionally at most `rate_limit_tokens_per_second` started per second; a request that
    cannot start waits in a bounded FIFO queue (`gateway.admission`)."""

    model_config = _frozen()

    max_concurrent_requests: int = Field(
        -1,
        ge=-1,
        description="Requests served at once, each until its answer is over; -1: no limit.",
    )
    queue_size: int = Field(
        100, ge=0, description="Requests waiting for a place; beyond: 429 (0: 429 at once)."
    )
    queue_timeout_secs: float = Field(
        60, gt=0, description="Longest wait in the queue, answered 408 past it."
    )
    rate_limit_tokens_per_second: float | None = Field(
        None,
        gt=0,
        description="Also start at most this many requests per second (a bucket of "
        "--max-concurrent-requests tokens refilled at this rate); none: no rate limit.",
    )

    @field_validator("max_concurrent_requests")
    @classmethod
    def _limit(cls, value: int) -> int:
        if value == 0:
            raise ValueError("0 would refuse every request: give a positive limit or -1")
        return value


class EdgeConfig(BaseModel):
    """What the gateway does at its client edge besides routing: request ids, CORS, log
    files, and DP-rank pinning."""

    model_config = _frozen()

    request_id_headers: list[str] = Field(
        default_factory=lambda: list(DEFAULT_REQUEST_ID_HEADERS),
        description="Request headers carrying the client's request id, in order; it is "
        "answered as x-request-id and sent to the workers (none given: one is made).",
    )
    cors_allowed_origins: list[str] = Field(
        default_factory=list,
        description="Origins allowed to call the gateway from a browser; '*' allows any "
        "(none: no CORS headers).",
    )
    log_dir: str | None = Field(
        None, min_length=1, description="Also write the gateway's log to a file in this directory."
    )
    dp_aware: bool = Field(
        False,
        description="Pin the prefill's DP rank in each request (routed_dp_rank, and "
        "disagg_prefill_dp_rank on the decode) where rooms cannot steer it.",
    )

    shutdown_grace_period_secs: float = Field(
        5.0,
        ge=0,
        description="On SIGTERM, how long answers in flight may take before they are cut.",
    )

    @field_validator("request_id_headers")
    @classmethod
    def _header_names(cls, names: list[str]) -> list[str]:
        for name in names:
            if not _TOKEN.fullmatch(name):
                raise ValueError(f"{name!r} is not an HTTP header name")
        return [name.lower() for name in names]

    @field_validator("cors_allowed_origins")
    @classmethod
    def _origins(cls, origins: list[str]) -> list[str]:
        for origin in origins:
            if origin != "*" and not _ORIGIN.fullmatch(origin):
                raise ValueError(f"{origin!r} is not an origin (scheme://host[:port]) or '*'")
        return origins


_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}")
_ORIGIN = re.compile(r"https?://(\[[0-9A-Fa-f:.]+\]|[^\s/?#:\[\]@]{1,253})(:[0-9]{1,5})?")

# --- end of the Kubernetes-native settings ---


DEFAULT_TRACES_ENDPOINT = "http://localhost:4318/v1/traces"
"""Where `--enable-trace` alone sends spans: a local OpenTelemetry collector's OTLP/HTTP
receiver (sglang-router's default, localhost:4317, is OTLP over gRPC)."""


class GatewayConfig(BaseModel):
    model_config = _frozen()

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
