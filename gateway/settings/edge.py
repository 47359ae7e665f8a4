"""The gateway's client edge besides routing: admission control, request ids, CORS, log
files, DP-rank pinning and the shutdown's grace (sglang-router 0.3.2's flags of the same
names; `docs/sglang-router-flags.md` compares them)."""

from __future__ import annotations

import re

from pydantic import BaseModel, Field, field_validator

from gateway.settings.base import frozen

DEFAULT_REQUEST_ID_HEADERS = ("x-request-id", "x-correlation-id", "x-trace-id", "request-id")
"""sglang-router's: the request headers that carry a client's request id, first found wins."""


class AdmissionConfig(BaseModel):
    """sglang-router's admission flags: at most `max_concurrent_requests` served at once,
    optionally at most `rate_limit_tokens_per_second` started per second; a request that
    cannot start waits in a bounded FIFO queue (`gateway.flow.admission`)."""

    model_config = frozen()

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

    model_config = frozen()

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
