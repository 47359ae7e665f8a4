"""How the gateway knows its workers: each one given (`WorkerSpec`, its KV-event endpoints),
followed (discovery), checked (health), cut off (the circuit breaker) and retried."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from gateway.settings.base import Kind, Role, frozen
from globalkv.discovery.kubernetes import parse_selector
from kvplumbing.addresses import check_http_url


class KvEventsSpec(BaseModel):
    """Where a prefill pod publishes KV events, for the indexer to subscribe to."""

    model_config = frozen()

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

    model_config = frozen()

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
    model_config = frozen()

    max_retries: int = Field(5, ge=1, description="Total attempts per request, first included.")
    initial_backoff_ms: int = Field(50, ge=0, description="Delay before the second attempt.")
    max_backoff_ms: int = Field(30_000, ge=0, description="Cap on one delay.")
    backoff_multiplier: float = Field(1.5, ge=1.0, description="Growth of the delay per attempt.")
    jitter_factor: float = Field(0.2, ge=0.0, le=1.0, description="± fraction of random jitter.")
    disabled: bool = Field(False, description="One attempt only.")


class BreakerConfig(BaseModel):
    model_config = frozen()

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
    model_config = frozen()

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


# Kubernetes-native discovery: sglang-router 0.3.2's flags of the same names
# (`docs/sglang-router-flags.md` compares them).


class DiscoveryConfig(BaseModel):
    """Workers found and followed rather than listed: Kubernetes pods by labels, or a file
    (`globalkv.discovery`), added to and removed from the pool as the source changes."""

    model_config = frozen()

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
