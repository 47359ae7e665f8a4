"""What a worker tells of itself over HTTP, read once it answers (`monitor` applies it).

SGLang (and our emulated engines) answer `GET /server_info` with their KV-event
endpoints, DP size, page size, bootstrap port and capacity. vLLM answers none outside its
dev mode, so for a worker whose `/server_info` names no KV events `GET /kv_event_sources`
is asked (vLLM's publishers per DP rank), and a vLLM worker's `/metrics` for its block
size and capacity (`server_info` parses all three). A worker that answers neither
endpoint advertises nothing: what was given with it (its `kv_events`) is all there is.

An answer that may change on asking again (a transport error, a 5xx while the engine
starts) makes the whole read `Retry`: the monitor asks again at its next round. A 404 or
405 says the worker has no such endpoint, for good.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import httpx

from gateway.settings.workers import KvEventsSpec
from gateway.workers.pool import Worker
from gateway.workers.server_info import (
    EventSources,
    ServerInfo,
    VllmCache,
    parse_kv_event_sources,
    parse_server_info,
    parse_vllm_cache,
)

log = logging.getLogger(__name__)

_ABSENT = frozenset({404, 405})
"""Statuses saying a worker has no such endpoint: nothing to discover there."""


@dataclass(frozen=True, slots=True)
class Retry:
    """Nothing usable yet; asked again next round."""

    error: str


@dataclass(frozen=True, slots=True)
class Advertised:
    info: ServerInfo
    sources: EventSources
    """From /kv_event_sources; empty when /server_info told the events or it was absent."""
    cache: VllmCache
    """From a vLLM worker's /metrics; empty for other workers."""
    silent: str | None = None
    """Set when the worker answered neither /server_info nor /kv_event_sources: what to
    show as its discovery error."""

    @property
    def kv_events(self) -> KvEventsSpec | None:
        return self.info.kv_events or self.sources.kv_events

    @property
    def block_size(self) -> int | None:
        return self.info.block_size or self.cache.block_size

    @property
    def dp_size(self) -> int | None:
        return self.info.dp_size or self.sources.dp_size

    @property
    def capacity_tokens(self) -> int | None:
        return self.info.kv_capacity_tokens or self.cache.capacity_tokens


async def read_advertised(
    client: httpx.AsyncClient, worker: Worker, timeout: float
) -> Advertised | Retry:
    """Everything `worker` advertises of itself, or `Retry`."""
    server_info = await _get_json(client, worker.url + "/server_info", timeout)
    if isinstance(server_info, Retry):
        return server_info
    info = parse_server_info(server_info or {}, worker.host)
    sources = EventSources()
    vllm = worker.kind == "vllm"
    if info.kv_events is None:
        answer = await _get_json(client, worker.url + "/kv_event_sources", timeout)
        if isinstance(answer, Retry):
            return answer
        if answer is not None:
            sources = parse_kv_event_sources(answer, worker.host)
            vllm = True
    cache = await _vllm_cache(client, worker, timeout) if vllm else VllmCache()
    silent = None
    if server_info is None and not vllm:
        silent = "neither /server_info nor /kv_event_sources answered"
    return Advertised(info, sources, cache, silent)


async def _get_json(
    client: httpx.AsyncClient, url: str, timeout: float
) -> dict[str, object] | Retry | None:
    """The JSON object at `url`; None when the worker has no such endpoint."""
    path = url[url.find("/", url.find("//") + 2) :]
    try:
        response = await client.get(url, timeout=timeout)
    except httpx.HTTPError as exc:
        return Retry(f"{path}: {exc!r}")
    if response.status_code in _ABSENT:
        return None
    body: object = None
    if response.status_code == 200:
        try:
            body = response.json()
        except ValueError:
            body = None
    if not isinstance(body, dict):
        return Retry(f"{path} answered {response.status_code} without a JSON object")
    return body


async def _vllm_cache(client: httpx.AsyncClient, worker: Worker, timeout: float) -> VllmCache:
    """vLLM tells its block size and capacity only on /metrics; a failure there tells
    nothing (the index's block size and no capacity are used)."""
    try:
        response = await client.get(worker.url + "/metrics", timeout=timeout)
    except httpx.HTTPError as exc:
        log.info("%s %s: nothing read from /metrics: %r", worker.role, worker.id, exc)
        return VllmCache()
    cache = parse_vllm_cache(response.text) if response.status_code == 200 else VllmCache()
    if cache.capacity_tokens is None:
        log.info("%s %s: /metrics tells no KV capacity", worker.role, worker.id)
    return cache
