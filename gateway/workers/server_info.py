"""What routing needs to know of a prefill, read from what the engine itself publishes.

From `/server_info` (our emulated engines' and real SGLang's shape): the KV-event
endpoints (the `kv_events` block: a ready URL, or SGLang's descriptor of a host and a
base port per endpoint; else SGLang's `kv_events_config` server argument, a JSON
string — also where a descriptor without a replay endpoint finds it), the DP size,
the page size, the bootstrap port and the served model; and the KV cache's capacity in
tokens, which the prefix policy's pressure cost divides by: our engines' per-rank
`kv_cache` pages, else SGLang's `max_total_num_tokens` (one scheduler's pool; every DP
rank has one of its own).

vLLM serves no `/server_info` outside its dev mode. Its KV-event publishers are on
`GET /kv_event_sources` (vLLM 0.32 serves it): one `KVEventsConfig` per DP rank, keyed by
the rank, as each engine core resolved it; `{}` when events are off. Its block size and
capacity are on `/metrics`, in the labels of the `vllm:cache_config_info` info gauge
(`block_size`; `num_gpu_blocks` × `block_size`, one series per engine core when it runs DP
ranks), read with prometheus_client's own parser.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gateway.settings.workers import KvEventsSpec
from globalkv.registry import MAX_DP_SIZE

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
    block = _mapping(info.get("kv_events"))
    config = _mapping(_json(info.get("kv_events_config")))
    block_size = int_or_none(info.get("page_size"))
    dp_size = int_or_none(info.get("dp_size"))
    kv_events = None
    endpoint = _dialable(block, "endpoint", host) or _dialable(config, "endpoint", host)
    connects = block.get("bind") is False
    if endpoint is not None or (connects and isinstance(block.get("topic"), str)):
        replay = _dialable(block, "replay_endpoint", host) or _dialable(
            config, "replay_endpoint", host
        )
        topic = block.get("topic", config.get("topic"))
        # "bind": false — the engine connects to a bound indexer SUB; `endpoint` is then
        # the indexer's address, and the pod is recognised there by its topic.
        kv_events = KvEventsSpec(
            endpoint=None if connects else endpoint,
            replay_endpoint=replay,
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


def _dialable(block: Mapping[str, Any], name: str, host: str) -> str | None:
    """DP rank 0's `name` endpoint of a KV-events block, made connectable: the URL given,
    else SGLang's descriptor's `<name>_host` (a wildcard: the worker's host) and
    `<name>_port_base`; per-rank ports follow from the base."""
    given = block.get(name)
    if isinstance(given, str):
        return _endpoint_for(given, host)
    port = int_or_none(block.get(f"{name}_port_base"))
    if port is None or not 0 < port < 65536:
        return None
    named = block.get(f"{name}_host")
    shown = named if isinstance(named, str) and named not in _WILDCARD_HOSTS else host
    if ":" in shown and not shown.startswith("["):
        shown = f"[{shown}]"
    return f"tcp://{shown}:{port}"


def _json(value: object) -> object:
    """SGLang's `kv_events_config` server argument: a JSON string."""
    if not isinstance(value, str):
        return None
    try:
        return json.loads(value)
    except ValueError:
        return None


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


@dataclass(frozen=True, slots=True)
class VllmCache:
    """What a vLLM /metrics text tells of its KV cache; None where it does not tell."""

    block_size: int | None = None
    capacity_tokens: int | None = None


def parse_vllm_cache(metrics: str) -> VllmCache:
    """The block size and the KV capacity in tokens (the sum over its engine cores of
    `num_gpu_blocks` × `block_size`) from a vLLM /metrics text. The capacity is None when
    the gauge is not yet filled in (vLLM shows "None" before its memory profiling); both
    are None when the gauge is absent, its cores disagree on the block size, or the text
    is not Prometheus's."""
    total = 0
    sizes: set[int | None] = set()
    unfilled = False
    try:
        for family in text_string_to_metric_families(metrics):
            if family.name not in _VLLM_CACHE_CONFIG:
                continue
            for sample in family.samples:
                size = _positive(sample.labels.get("block_size"))
                blocks = _positive(sample.labels.get("num_gpu_blocks"))
                sizes.add(size)
                if blocks is None or size is None:
                    unfilled = True
                else:
                    total += blocks * size
    except ValueError:
        return VllmCache()
    if len(sizes) != 1:
        return VllmCache()
    return VllmCache(block_size=sizes.pop(), capacity_tokens=None if unfilled else total or None)


@dataclass(frozen=True, slots=True)
class EventSources:
    """What a vLLM /kv_event_sources answer tells: the pod's KV-event spec and its DP
    size, or why it cannot be used (`problem`); neither when the engine publishes none."""

    kv_events: KvEventsSpec | None = None
    dp_size: int | None = None
    problem: str | None = None


def parse_kv_event_sources(body: object, host: str) -> EventSources:
    """The KV-event spec of a vLLM engine from its `GET /kv_event_sources` answer
    (`{"<dp rank>": KVEventsConfig, …}`), made connectable from the worker's `host`.

    Which side binds follows vLLM's own rule (`ZmqEventPublisher._is_bind_endpoint`): an
    endpoint with `*` or `::`, or ipc/inproc, is bound by the engine and the indexer
    connects to it; any other is where the engine connects, the indexer's bound SUB, and
    the pod is known there by its topic. Every rank must follow rank 0 at port + rank (the
    only layout a registered pod can describe, and vLLM's for a fixed port).
    """
    if not isinstance(body, Mapping):
        return EventSources(problem="/kv_event_sources is not a JSON object")
    ranks: dict[int, Mapping[str, Any]] = {}
    for key, config in body.items():
        if not (isinstance(key, str) and key.isdigit() and isinstance(config, Mapping)):
            return EventSources(problem=f"/kv_event_sources has an entry {key!r} of no DP rank")
        if config.get("publisher") == "zmq" and isinstance(config.get("endpoint"), str):
            ranks[int(key)] = config
    if not ranks:
        return EventSources()
    if sorted(ranks) != list(range(len(ranks))) or len(ranks) > MAX_DP_SIZE:
        return EventSources(problem=f"/kv_event_sources lists DP ranks {sorted(ranks)}")
    first = ranks[0]
    topic = first.get("topic")
    if not isinstance(topic, str):
        return EventSources(problem="/kv_event_sources names no topic")
    endpoint, replay = first["endpoint"], first.get("replay_endpoint")
    for rank, config in ranks.items():
        for name, base in (("endpoint", endpoint), ("replay_endpoint", replay)):
            if config.get(name) != _offset(base, rank):
                return EventSources(
                    problem=f"/kv_event_sources: DP rank {rank}'s {name} "
                    f"{config.get(name)!r} is not rank 0's port + {rank}"
                )
    binds = "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
    spec = KvEventsSpec(
        endpoint=_endpoint_for(endpoint, host) if binds else None,
        replay_endpoint=_endpoint_for(replay, host) if isinstance(replay, str) else None,
        topic=topic,
        mode="connect" if binds else "bind",
    )
    return EventSources(kv_events=spec, dp_size=len(ranks))


def _offset(endpoint: object, rank: int) -> object:
    """vLLM's per-rank endpoint (`offset_endpoint_port`): a tcp port + rank, an inproc
    name with `_dp<rank>`; a port of 0 stays 0."""
    if not isinstance(endpoint, str) or rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    base, sep, port = endpoint.rpartition(":")
    if "tcp" not in endpoint or not sep or not port.isdigit() or port == "0":
        return endpoint
    return f"{base}:{int(port) + rank}"


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
