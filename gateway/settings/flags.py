"""`globalkv gateway`'s flags: sglang-router's as they are, plus the index's, read into
`GatewayConfig`.

Each setting's flag is derived from the field that holds it (type, default, help), so the
command line and the model cannot disagree; the fields set by flags of sglang-router's
own shape (`--prefill URL PORT`, `--policy`, `--prometheus-port 0`, …) are listed in
`FLAGLESS` with the flag that sets them. `--policy` sets both sides as in sglang-router;
without it prefill uses `prefix` and decode `power_of_two`.
"""

from __future__ import annotations

import argparse
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ValidationError

from gateway.settings.base import optional_float
from gateway.settings.config import GatewayConfig
from gateway.settings.edge import AdmissionConfig, EdgeConfig
from gateway.settings.flow import FlowConfig
from gateway.settings.peer_flags import FLAGS_DOC, add_peer_flags, check_peer_flags
from gateway.settings.routing import CacheAwareConfig, PdDeciderConfig, PrefixWeights
from gateway.settings.workers import (
    BreakerConfig,
    DiscoveryConfig,
    HealthConfig,
    RetryConfig,
    WorkerSpec,
)
from kvplumbing.validation import validation_message

POLICIES = ["prefix", "cache_aware", "power_of_two", "round_robin", "random", "least_load"]


SETTINGS: tuple[tuple[str, type[BaseModel], dict[str, str]], ...] = (
    (
        "gateway",
        GatewayConfig,
        {
            "host": "--host",
            "port": "--port",
            "prometheus_host": "--prometheus-host",
            "api_key": "--api-key",
            "admin_token": "--admin-token",
            "insecure": "--insecure",
            "request_timeout_secs": "--request-timeout-secs",
            "max_payload_size": "--max-payload-size",
            "max_buffered_payload_size": "--max-buffered-payload-size",
            "max_client_connections": "--max-client-connections",
            "enable_trace": "--enable-trace",
            "otlp_traces_endpoint": "--otlp-traces-endpoint",
            "redis_url": "--redis-url",
            "redis_prefix": "--redis-prefix",
            "indexer_url": "--indexer-url",
            "share_state_interval_secs": "--share-state-interval-secs",
            "indexer_token": "--indexer-token",
            "model": "--model",
            "block_size": "--block-size",
            "lookup_timeout_secs": "--lookup-timeout-secs",
            "seed": "--seed",
            "vllm_allow_recompute": "--vllm-allow-recompute",
        },
    ),
    (
        "prefix policy",
        PrefixWeights,
        {
            "uncached_weight": "--prefix-uncached-weight",
            "queued_weight": "--prefix-queued-weight",
            "request_cost": "--prefix-request-cost",
            "pressure_weight": "--prefix-pressure-weight",
            "pending_grace_secs": "--prefix-pending-grace-secs",
            "session_ttl_secs": "--session-ttl-secs",
            "sessions_max": "--sessions-max",
        },
    ),
    (
        "cache_aware policy",
        CacheAwareConfig,
        {
            "cache_threshold": "--cache-threshold",
            "balance_abs_threshold": "--balance-abs-threshold",
            "balance_rel_threshold": "--balance-rel-threshold",
            "eviction_interval_secs": "--eviction-interval-secs",
            "max_tree_size": "--max-tree-size",
        },
    ),
    (
        "disaggregation decider",
        PdDeciderConfig,
        {
            "mode": "--pd-decider",
            "transfer_tokens_per_s": "--pd-transfer-tokens-per-s",
            "itl_weight": "--pd-decider-itl-weight",
        },
    ),
    (
        "retries",
        RetryConfig,
        {
            "max_retries": "--retry-max-retries",
            "initial_backoff_ms": "--retry-initial-backoff-ms",
            "max_backoff_ms": "--retry-max-backoff-ms",
            "backoff_multiplier": "--retry-backoff-multiplier",
            "jitter_factor": "--retry-jitter-factor",
            "disabled": "--disable-retries",
        },
    ),
    (
        "circuit breaker",
        BreakerConfig,
        {
            "failure_threshold": "--cb-failure-threshold",
            "success_threshold": "--cb-success-threshold",
            "timeout_duration_secs": "--cb-timeout-duration-secs",
            "window_duration_secs": "--cb-window-duration-secs",
            "disabled": "--disable-circuit-breaker",
        },
    ),
    (
        "health checks",
        HealthConfig,
        {
            "failure_threshold": "--health-failure-threshold",
            "success_threshold": "--health-success-threshold",
            "timeout_secs": "--health-check-timeout-secs",
            "interval_secs": "--health-check-interval-secs",
            "endpoint": "--health-check-endpoint",
            "disabled": "--disable-health-check",
            "startup_check_interval_secs": "--worker-startup-check-interval",
            "directory_refresh_secs": "--directory-refresh-secs",
            "registration_check_secs": "--registration-check-secs",
        },
    ),
    # Kubernetes-native settings: sglang-router's flags of the same names.
    (
        "service discovery",
        DiscoveryConfig,
        {
            "service_discovery": "--service-discovery",
            "prefill_selector": "--prefill-selector",
            "decode_selector": "--decode-selector",
            "selector": "--selector",
            "port": "--service-discovery-port",
            "decode_port": "--decode-service-discovery-port",
            "namespace": "--service-discovery-namespace",
            "bootstrap_port_annotation": "--bootstrap-port-annotation",
            "worker_file": "--worker-file",
        },
    ),
    (
        "admission control",
        AdmissionConfig,
        {
            "max_concurrent_requests": "--max-concurrent-requests",
            "queue_size": "--queue-size",
            "queue_timeout_secs": "--queue-timeout-secs",
            "rate_limit_tokens_per_second": "--rate-limit-tokens-per-second",
        },
    ),
    (
        "flow control",
        FlowConfig,
        {
            "enabled": "--flow-control",
            "objectives": "--flow-objectives",
            "fairness_headers": "--flow-fairness-headers",
            "objective_headers": "--flow-objective-headers",
            "max_tenants": "--flow-max-tenants",
            "max_queued_bytes": "--flow-max-queued-bytes",
            "usage_half_life_secs": "--flow-usage-half-life-secs",
            "reserve_prefills": "--flow-reserve-prefills",
            "reserve_secs": "--flow-reserve-secs",
        },
    ),
    (
        "client edge",
        EdgeConfig,
        {
            "request_id_headers": "--request-id-headers",
            "cors_allowed_origins": "--cors-allowed-origins",
            "log_dir": "--log-dir",
            "dp_aware": "--dp-aware",
            "shutdown_grace_period_secs": "--shutdown-grace-period-secs",
        },
    ),
)
"""Each setting's flag (sglang-router's name where it has the setting), by the model that
holds it: type, default and help come from the field, so the two cannot disagree."""

FLAGLESS = {
    GatewayConfig: {
        "prefill": "--prefill URL [BOOTSTRAP_PORT|none], repeatable",
        "decode": "--decode URL, repeatable; --vllm-prefill URL / --vllm-decode URL for vLLM",
        "prefill_policy": "--prefill-policy, else --policy",
        "decode_policy": "--decode-policy, else --policy",
        "tokenizer": "--tokenizer / --tokenizer-path, else --model-path",
        "prometheus_port": "--prometheus-port, where 0 means none",
        "prefix": "its own flags",
        "cache_aware": "its own flags",
        "pd_decider": "its own flags",
        "retry": "its own flags",
        "breaker": "its own flags",
        "health": "its own flags",
        "discovery": "its own flags",
        "admission": "its own flags",
        "flow": "its own flags",
        "edge": "its own flags",
    },
}
"""Fields set by a flag of sglang-router's own shape (see `_add_router_flags`), with how."""

_SECTIONS: dict[type[BaseModel], str] = {
    PrefixWeights: "prefix",
    CacheAwareConfig: "cache_aware",
    PdDeciderConfig: "pd_decider",
    RetryConfig: "retry",
    BreakerConfig: "breaker",
    HealthConfig: "health",
    DiscoveryConfig: "discovery",
    AdmissionConfig: "admission",
    FlowConfig: "flow",
    EdgeConfig: "edge",
}


def _dest(model: type[BaseModel], field: str) -> str:
    return f"{model.__name__}.{field}"


def _kind(annotation: Any) -> Any:
    """The flag's type for a field annotated `annotation` (`X | None` takes X)."""
    kinds = [a for a in get_args(annotation) if a is not type(None)] or [annotation]
    return kinds[0]


def _add_setting(
    group: argparse._ArgumentGroup, model: type[BaseModel], field: str, flag: str
) -> None:
    info = model.model_fields[field]
    default = info.get_default(call_default_factory=True)
    help_text = f"{info.description} (default: {default})".replace("%", "%%")
    dest = _dest(model, field)
    if info.annotation is bool:
        group.add_argument(flag, dest=dest, action="store_true", default=default, help=help_text)
        return
    if get_origin(info.annotation) is Literal:
        group.add_argument(
            flag, dest=dest, choices=get_args(info.annotation), default=default, help=help_text
        )
        return
    if get_origin(info.annotation) is list:
        group.add_argument(
            flag, dest=dest, nargs="*", default=default, metavar="VALUE", help=help_text
        )
        return
    kind = _kind(info.annotation)
    if flag == "--prefix-pending-grace-secs":
        kind = optional_float  # seconds, or off
    group.add_argument(
        flag, dest=dest, type=kind, default=default, metavar=field.upper(), help=help_text
    )


def _add_router_flags(p: argparse.ArgumentParser) -> None:
    """sglang-router's flags that are not one field each."""
    add = p.add_argument
    add("--pd-disaggregation", action="store_true", help="PD mode (the only mode; accepted)")
    add(
        "--prefill",
        nargs="+",
        action="append",
        default=[],
        metavar="URL [BOOTSTRAP_PORT|none]",
        help="a prefill worker and its bootstrap port (none or omitted: null); repeatable",
    )
    add(
        "--decode",
        nargs=1,
        action="append",
        default=[],
        metavar="URL",
        help="a decode worker; repeatable",
    )
    add(
        "--vllm-prefill",
        action="append",
        default=[],
        metavar="URL",
        help="a vLLM prefill worker (kv_transfer_params protocol); repeatable",
    )
    add(
        "--vllm-decode",
        action="append",
        default=[],
        metavar="URL",
        help="a vLLM decode worker; repeatable (--prefill/--decode workers are detected)",
    )
    add("--worker-urls", nargs="*", default=[], help="sglang-router's regular mode: refused")
    fields = GatewayConfig.model_fields
    add("--policy", choices=POLICIES, help="policy of both sides unless overridden")
    add("--prefill-policy", choices=POLICIES, help=f"default: {fields['prefill_policy'].default}")
    add("--decode-policy", choices=POLICIES, help=f"default: {fields['decode_policy'].default}")
    add(
        "--prometheus-port",
        type=int,
        default=fields["prometheus_port"].default,
        help=f"{fields['prometheus_port'].description} 0 = only /metrics on --port "
        f"(default: {fields['prometheus_port'].default})",
    )
    add(
        "--tokenizer",
        "--tokenizer-path",
        dest="tokenizer",
        help=fields["tokenizer"].description,
    )
    add("--model-path", help="sglang-router: a local model directory used as the tokenizer")
    add(
        "--router-log-level",
        "--log-level",
        dest="router_log_level",
        choices=["debug", "info", "warn", "warning", "error"],
        help="sglang-router's log level flag, applied to the gateway's loggers",
    )


def add_flags(p: argparse.ArgumentParser) -> None:
    _add_router_flags(p)
    add_peer_flags(p)
    for title, model, flags in SETTINGS:
        group = p.add_argument_group(title)
        for field, flag in flags.items():
            _add_setting(group, model, field, flag)


def _prefill_spec(values: list[str]) -> WorkerSpec:
    if len(values) > 2:
        raise ValueError(f"--prefill takes URL [BOOTSTRAP_PORT|none], got {' '.join(values)}")
    port: int | None = None
    if len(values) == 2 and values[1].lower() != "none":
        if not values[1].isdigit():
            raise ValueError(f"--prefill bootstrap port must be a number or none: {values[1]!r}")
        port = int(values[1])
    return WorkerSpec(url=values[0], role="prefill", bootstrap_port=port)


def _settings(args: argparse.Namespace, model: type[BaseModel]) -> dict[str, Any]:
    flags = next(flags for _, m, flags in SETTINGS if m is model)
    return {field: getattr(args, _dest(model, field)) for field in flags}


def build_config(args: argparse.Namespace) -> GatewayConfig:
    """The typed configuration; `ValueError` with the reason when the flags are wrong."""
    if args.worker_urls:
        raise ValueError(
            "--worker-urls (regular mode) is not supported: use --prefill/--decode "
            f"(see {FLAGS_DOC})"
        )
    check_peer_flags(args)
    fields = GatewayConfig.model_fields
    try:
        sections = {name: model(**_settings(args, model)) for model, name in _SECTIONS.items()}
        return GatewayConfig(
            **_settings(args, GatewayConfig),
            **sections,
            prometheus_port=args.prometheus_port or None,
            prefill=[
                *(_prefill_spec(v) for v in args.prefill),
                *(WorkerSpec(url=u, role="prefill", kind="vllm") for u in args.vllm_prefill),
            ],
            decode=[
                *(WorkerSpec(url=v[0], role="decode") for v in args.decode),
                *(WorkerSpec(url=u, role="decode", kind="vllm") for u in args.vllm_decode),
            ],
            prefill_policy=args.prefill_policy or args.policy or fields["prefill_policy"].default,
            decode_policy=args.decode_policy or args.policy or fields["decode_policy"].default,
            tokenizer=args.tokenizer or args.model_path,
        )
    except ValidationError as exc:
        raise ValueError(validation_message(exc)) from None
