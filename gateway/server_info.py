"""What routing needs to know of a prefill, read from what the engine itself publishes.

From `/server_info` (our emulated engines' and real SGLang's shape): the KV-event
endpoints (our `kv_events` block, or SGLang's `kv_events_config` JSON string), the DP size,
the page size, the bootstrap port and the served model; and the KV cache's capacity in
tokens, which the prefix policy's pressure cost divides by: our engines' per-rank
`kv_cache` pages, else SGLang's `max_total_num_tokens` (one scheduler's pool; every DP
rank has one of its own).

vLLM serves no `/server_info` outside its dev mode; its capacity is on `/metrics`, in the
labels of the `vllm:cache_config_info` info gauge (`num_gpu_blocks` × `block_size`, one
series per engine core when it runs DP ranks), read with prometheus_client's own parser.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gateway.config import KvEventsSpec

_WILDCARD_HOSTS = {"*", "0.0.0.0", "::", "[::]", ""}
_VLLM_CACHE_CONFIG = {"vllm:cache_config_info", "vllm:cache_config"}
"""The family's name as vLLM declares it (a gauge), and as an `info` type would name it."""


@dataclass(frozen=True, slots=True)
class ServerInfo:
    kv_events: KvEventsSpec | None
    bootstrap_port: int | None
    dp_size: int | None
    block_size: int | None
    model: str | None
    kv_capacity_tokens: int | None = None


def parse_server_info(info: Mapping[str, Any], host: str) -> ServerInfo:
    """What routing needs from a worker's /server_info, from either engine's shape."""
    block: object = info.get("kv_events")
    if block is None and isinstance(info.get("kv_events_config"), str):
        with contextlib.suppress(ValueError):
            block = json.loads(info["kv_events_config"])
    kv_events = None
    block_size = int_or_none(info.get("page_size"))
    dp_size = int_or_none(info.get("dp_size"))
    if isinstance(block, Mapping) and isinstance(block.get("endpoint"), str):
        replay = block.get("replay_endpoint")
        topic = block.get("topic")
        # "bind": false — the engine connects to a bound indexer SUB; `endpoint` is then
        # the indexer's address, and the pod is recognised there by its topic.
        connects = block.get("bind") is False
        kv_events = KvEventsSpec(
            endpoint=None if connects else _endpoint_for(block["endpoint"], host),
            replay_endpoint=_endpoint_for(replay, host) if isinstance(replay, str) else None,
            topic=topic if isinstance(topic, str) else "",
            mode="bind" if connects else "connect",
        )
        block_size = int_or_none(block.get("block_size")) or block_size
        dp_size = int_or_none(block.get("dp_size")) or dp_size
    model = info.get("served_model_name") or info.get("model")
    return ServerInfo(
        kv_events=kv_events,
        bootstrap_port=int_or_none(info.get("disaggregation_bootstrap_port"))
        or int_or_none(info.get("bootstrap_port")),
        dp_size=dp_size,
        block_size=block_size,
        model=model if isinstance(model, str) else None,
        kv_capacity_tokens=_kv_capacity_tokens(info, block_size, dp_size),
    )


def parse_vllm_capacity(metrics: str) -> int | None:
    """KV capacity in tokens from a vLLM /metrics text: the sum over its engine cores of
    `num_gpu_blocks` × `block_size`; None when the gauge is absent or not yet filled in
    (vLLM shows "None" before its memory profiling) or the text is not Prometheus's."""
    total = 0
    try:
        for family in text_string_to_metric_families(metrics):
            if family.name not in _VLLM_CACHE_CONFIG:
                continue
            for sample in family.samples:
                blocks = _positive(sample.labels.get("num_gpu_blocks"))
                size = _positive(sample.labels.get("block_size"))
                if blocks is None or size is None:
                    return None
                total += blocks * size
    except ValueError:
        return None
    return total or None


def _kv_capacity_tokens(
    info: Mapping[str, Any], block_size: int | None, dp_size: int | None
) -> int | None:
    ranks = info.get("kv_cache")
    if ranks is None:
        per_rank = int_or_none(info.get("max_total_num_tokens"))
        if per_rank is None or per_rank <= 0:
            return None
        return per_rank * (dp_size or 1)
    if block_size is None or not isinstance(ranks, list) or not ranks:
        return None
    pages = [int_or_none(r.get("capacity")) if isinstance(r, Mapping) else None for r in ranks]
    if any(p is None or p <= 0 for p in pages):
        return None
    return sum(p for p in pages if p is not None) * block_size


def _endpoint_for(endpoint: str | None, host: str) -> str | None:
    """A bind address (`tcp://*:5557`) made connectable (`tcp://<worker host>:5557`)."""
    if endpoint is None or not endpoint.startswith("tcp://"):
        return endpoint
    rest = endpoint[len("tcp://") :]
    bind_host, sep, port = rest.rpartition(":")
    if sep and bind_host in _WILDCARD_HOSTS:
        shown = f"[{host}]" if ":" in host else host
        return f"tcp://{shown}:{port}"
    return endpoint


def int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _positive(text: str | None) -> int | None:
    if text is None or not text.isdigit():
        return None
    value = int(text)
    return value if value > 0 else None
