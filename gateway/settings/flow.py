"""Flow control's settings (`--flow-*`), a section of `GatewayConfig`.

The objectives are InferenceObjective's in a flag: a name a request gives in a header,
the priority it stands for (the CRD's `spec.priority`: an int32, higher first, negative
allowed, unset meaning 0), and optionally a time to first token to hold it to, which the
CRD does not carry (llm-d reads one per request from `x-llm-d-slo-ttft-ms`; here an
objective can set it for every request naming it).
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEFAULT_FAIRNESS_HEADERS = ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id")
"""Where llm-d 1.0 and the Gateway API Inference Extension read a request's fairness id."""
DEFAULT_OBJECTIVE_HEADERS = ("x-llm-d-inference-objective", "x-gateway-inference-objective")
"""Where they read the name of its InferenceObjective."""
DEFAULT_TTFT_HEADERS = ("x-llm-d-slo-ttft-ms", "x-slo-ttft-ms")
"""Where llm-d reads a request's own time-to-first-token objective, in milliseconds."""
DEFAULT_OBJECTIVE = "default"
"""The objective a request naming none (or one not configured) is given, when configured;
otherwise priority 0 and no time to first token, as llm-d does."""

INT32 = 2**31
MAX_TTFT_MS = 3_600_000.0
_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
"""A Kubernetes object name (DNS subdomain), as an InferenceObjective's metadata.name is."""
_OBJECTIVE = re.compile(r"(?P<name>[^=]+)=(?P<priority>[-+]?\d+)(/(?P<ttft>[0-9.eE+-]+))?")
_HEADER = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}")


def objective_name(text: str) -> bool:
    """Whether `text` can name an InferenceObjective."""
    return _NAME.fullmatch(text) is not None


class Objective(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    name: str = Field(description="What requests name in the objective header.")
    priority: int = Field(
        0, ge=-INT32, lt=INT32, description="Higher is served first; negative allowed."
    )
    ttft_ms: float | None = Field(
        None,
        gt=0,
        le=MAX_TTFT_MS,
        description="Release a request only when its first token is predicted within this, "
        "and keep this headroom for the objective's requests while they keep coming.",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not objective_name(value):
            raise ValueError(f"{value[:80]!r} is not an InferenceObjective name (a DNS subdomain)")
        return value

    @property
    def ttft_s(self) -> float | None:
        return None if self.ttft_ms is None else self.ttft_ms / 1000


def parse_objective(text: str) -> Objective:
    """`NAME=PRIORITY[/TTFT_MS]` as an `Objective`; `ValueError` saying what is wrong."""
    match = _OBJECTIVE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"--flow-objectives takes NAME=PRIORITY[/TTFT_MS], got {text[:80]!r}")
    ttft = match["ttft"]
    return Objective(
        name=match["name"],
        priority=int(match["priority"]),
        ttft_ms=None if ttft is None else float(ttft),
    )


class FlowConfig(BaseModel):
    """Per-tenant queues in priority bands (`gateway.flow`)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    enabled: bool = Field(
        False,
        description="Queue requests per (priority, tenant) instead of first come first served: "
        "higher priorities first, tenants of one priority by their recent usage, each released "
        "when the prefills have headroom for it (docs/flow-control.md).",
    )
    objectives: list[Objective] = Field(
        default_factory=list,
        description="InferenceObjectives: NAME=PRIORITY[/TTFT_MS], the name a request gives in "
        "an objective header; 'default' is given to requests naming none.",
    )
    fairness_headers: list[str] = Field(
        default_factory=lambda: list(DEFAULT_FAIRNESS_HEADERS),
        description="Request headers naming the tenant, first found wins; without one: the "
        "LoRA adapter, else the API key (hashed), else default-flow.",
    )
    objective_headers: list[str] = Field(
        default_factory=lambda: list(DEFAULT_OBJECTIVE_HEADERS),
        description="Request headers naming the request's objective, first found wins.",
    )
    max_tenants: int = Field(
        10_000, ge=1, description="Tenants whose usage is kept; past it the idle longest go."
    )
    max_queued_bytes: int = Field(
        256 * 1024 * 1024, ge=1, description="Request bytes held in the queues at once."
    )
    usage_half_life_secs: float = Field(
        30.0, gt=0, le=3600, description="Half-life of each tenant's usage, which fairness reads."
    )
    reserve_prefills: int = Field(
        1,
        ge=1,
        le=64,
        description="Prefills an active objective with a TTFT keeps within its headroom from "
        "lower priorities.",
    )
    reserve_secs: float = Field(
        30.0,
        ge=0,
        le=3600,
        description="An objective with a TTFT keeps its headroom from lower priorities this "
        "long after its last request (0: only while its requests wait).",
    )

    @field_validator("objectives", mode="before")
    @classmethod
    def _parsed(cls, items: object) -> object:
        """Each `NAME=PRIORITY[/TTFT_MS]` given as text (the flag's form) parsed."""
        if isinstance(items, list):
            return [parse_objective(i) if isinstance(i, str) else i for i in items]
        return items

    @field_validator("fairness_headers", "objective_headers")
    @classmethod
    def _headers(cls, names: list[str]) -> list[str]:
        for name in names:
            if not _HEADER.fullmatch(name):
                raise ValueError(f"{name!r} is not an HTTP header name")
        return [name.lower() for name in names]

    @model_validator(mode="after")
    def _distinct(self) -> FlowConfig:
        names = [o.name for o in self.objectives]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"objectives named twice: {', '.join(twice)}")
        return self
