"""`globalkv engine`: an emulated SGLang (or, with `--api vllm`, vLLM) prefill or decode engine.

Flags keep SGLang's names where SGLang has the setting (`--tp`, `--dp`, `--pp`,
`--page-size`, `--disaggregation-bootstrap-port` as `--bootstrap-port`,
`--load-balance-method`); every flag also reads `GLOBALKV_ENGINE_<FLAG>` through the
dispatcher. Flags left out take the defaults of `EngineConfig`, the one place they live.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any, get_args

import uvloop

from enginesim.config import (
    EngineConfig,
    FaultSettings,
    KVEventsSettings,
    LatencySettings,
)
from globalkv.wire import FLAVORS
from kvplumbing.validation import validation_as_value_error

log = logging.getLogger(__name__)

_TOP = {
    "role": ("--role", str),
    "api": ("--api", str),
    "host": ("--host", str),
    "port": ("--port", int),
    "advertise_host": ("--advertise-host", str),
    "model": ("--model", str),
    "lora_adapters": ("--lora-adapters", str),
    "pod_id": ("--pod-id", str),
    "tokenizer": ("--tokenizer", str),
    "tp": ("--tp", int),
    "dp": ("--dp", int),
    "pp": ("--pp", int),
    "page_size": ("--page-size", int),
    "kv_capacity": ("--kv-capacity", int),
    "bootstrap_port": ("--bootstrap-port", int),
    "bootstrap_admin_token": ("--bootstrap-admin-token", str),
    "bootstrap_insecure": ("--bootstrap-insecure", bool),
    "load_balance_method": ("--load-balance-method", str),
    "sglang_compat": ("--sglang-compat", str),
    "max_new_tokens": ("--max-new-tokens", int),
    "handshake_timeout": ("--handshake-timeout", float),
    "connect_timeout": ("--connect-timeout", float),
    "transfer_timeout": ("--transfer-timeout", float),
    "bootstrap_retry_interval": ("--bootstrap-retry-interval", float),
    "bootstrap_max_tries": ("--bootstrap-max-tries", int),
    "keepalive_interval": ("--keepalive-interval", float),
    "decode_kv_events": ("--decode-kv-events", bool),
}
_EVENTS = {
    "endpoint": ("--kv-events-endpoint", str),
    "replay_endpoint": ("--kv-events-replay-endpoint", str),
    "topic": ("--kv-events-topic", str),
    "format": ("--kv-events-format", str),
    "buffer_steps": ("--kv-events-buffer-steps", int),
    "hwm": ("--kv-events-hwm", int),
}
_LATENCY = {
    "prefill_tokens_per_s": ("--prefill-tokens-per-s", float),
    "prefill_overhead_ms": ("--prefill-overhead-ms", float),
    "max_batch_tokens": ("--max-batch-tokens", int),
    "decode_tokens_per_s": ("--decode-tokens-per-s", float),
}
_FAULTS = {
    "fail_rate": ("--fault-fail-rate", float),
    "wrong_room_rate": ("--fault-wrong-room-rate", float),
    "unready_room_rate": ("--fault-unready-room-rate", float),
    "drop_event_rate": ("--fault-drop-event-rate", float),
    "eos_rate": ("--fault-eos-rate", float),
    "seed": ("--fault-seed", int),
}
_GROUPS: tuple[tuple[str, type[Any], dict[str, tuple[str, type]]], ...] = (
    ("engine", EngineConfig, _TOP),
    ("KV events", KVEventsSettings, _EVENTS),
    ("latency model", LatencySettings, _LATENCY),
    ("fault injection", FaultSettings, _FAULTS),
)
_NONE_WORDS = {"none", "null", "off"}
_CHOICES: dict[str, list[str]] = {
    "--role": ["prefill", "decode"],
    "--api": ["sglang", "vllm"],
    "--kv-events-format": list(FLAVORS),
    "--load-balance-method": list(
        get_args(EngineConfig.model_fields["load_balance_method"].annotation)
    ),
    "--sglang-compat": list(get_args(EngineConfig.model_fields["sglang_compat"].annotation)),
}
_NULLABLE = {"--kv-events-endpoint", "--kv-events-replay-endpoint"}


def _help(model: type[Any], field: str) -> str:
    info = model.model_fields[field]
    default = "required" if info.is_required() else f"default: {info.default}"
    return f"{info.description} ({default})".replace("%", "%%")


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "engine",
        help="run an emulated SGLang prefill or decode engine",
        description="An SGLang-compatible prefill or decode engine without a GPU: HTTP "
        "surface, bootstrap directory, KV events with replay, the PD handshake, a latency "
        "model and fault injection. 'none' disables the KV-event endpoints.",
    )
    for title, model, flags in _GROUPS:
        group = parser.add_argument_group(title)
        for field, (flag, kind) in flags.items():
            if kind is bool:
                group.add_argument(
                    flag,
                    dest=f"{model.__name__}.{field}",
                    action="store_true",
                    default=None,
                    help=_help(model, field),
                )
                continue
            group.add_argument(
                flag,
                dest=f"{model.__name__}.{field}",
                type=str if flag in _NULLABLE else kind,
                choices=_CHOICES.get(flag),
                required=flag == "--role",
                metavar=None if flag in _CHOICES else field.upper(),
                default=None,
                help=_help(model, field),
            )
    parser.set_defaults(run=run, check_config=check_config)


def _given(
    args: argparse.Namespace, model: type[Any], flags: dict[str, tuple[str, type]]
) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for field, (flag, _) in flags.items():
        value = getattr(args, f"{model.__name__}.{field}")
        if value is None:
            continue
        values[field] = None if flag in _NULLABLE and value.lower() in _NONE_WORDS else value
    return values


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    with validation_as_value_error():
        return EngineConfig(
            **_given(args, EngineConfig, _TOP),
            kv_events=KVEventsSettings(**_given(args, KVEventsSettings, _EVENTS)),
            latency=LatencySettings(**_given(args, LatencySettings, _LATENCY)),
            faults=FaultSettings(**_given(args, FaultSettings, _FAULTS)),
        )


def check_config(args: argparse.Namespace) -> None:
    config_from_args(args)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        log.error("invalid configuration: %s", exc)
        return 2
    # Imported here: the dispatcher registers every command on each start, and the
    # engine's server stack should load only when an engine runs.
    import zmq

    from bootstrap.registrar import DirectoryRegistrationFailed
    from enginesim.runtime import EngineProcess, run_engine

    try:
        process = EngineProcess(config)
    except ValueError as exc:
        log.error("engine could not start: %s", exc)
        return 1
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(run_engine(process))
    except (OSError, zmq.ZMQError, DirectoryRegistrationFailed) as exc:
        log.error("engine could not start: %s", exc)
        return 1
    return 0
