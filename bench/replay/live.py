"""Live mode: the trace through real processes (`globalkv.stack.cluster.LocalCluster`).

Per policy a fresh local stack is started (gateway — or, with `entry: envoy`, Envoy, the
endpoint pickers and a sidecar per decode —, indexer, emulated prefill and decode engines,
each a `python -m globalkv …` child) with the same capacities and rates as the
simulation, time-scaled: the engines' rates are divided by the time scale and the
arrivals multiplied by it. Each request is sent at its (scaled) arrival time to the
gateway's `/generate` with `input_ids` (the deterministic expansion) and `stream: true`;
TTFT is measured at the first streamed chunk, and the cached tokens, queue and prefill
times are read from the answer's `meta_info`, as the engines report them. With
`engine: vllm` the stack's engines speak vLLM's protocol and each request goes to
`/v1/completions` with the ids as its prompt; the cached tokens come from the stream's
`usage.prompt_tokens_details` (vLLM reports no queue or prefill time there: 0). After the run,
every prefill's `/metrics` gives its computed and cached tokens and evictions.

What differs from the simulation: real overheads (HTTP, JSON bodies of thousands of ids,
ZMQ events and the indexer) that do not shrink with the time scale, and a real event
delay instead of the modelled one. The emulated engines model neither attention's
superlinear cost nor KV transfer time, so live mode refuses the first and the sim twin
must be configured without them (the settings refuse a live run that has either).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.redis_process import redis_server
from bench.replay.config import ReplaySettings, ResolvedCluster
from bench.replay.record import PodStats, Progress, ProgressHook, RunRecord
from bench.replay.tokens import expand
from bench.replay.trace import Trace, arrival_times
from gateway.policies import Choice
from gateway.settings.base import PolicyName
from globalkv.stack.cluster import LocalCluster, StackConfig

log = logging.getLogger(__name__)


def _flag(value: float) -> str:
    return repr(float(value))


def stack_config(
    settings: ReplaySettings,
    cluster: ResolvedCluster,
    policy: PolicyName,
    redis_url: str | None = None,
) -> StackConfig:
    """The local stack that emulates `cluster`, routing prefills with `policy`; with
    several gateways sharing their state, through the Redis at `redis_url`."""
    scale = settings.time_scale
    prefill = ["--kv-capacity", str(cluster.capacity_blocks)]
    prefill += ["--prefill-tokens-per-s", _flag(cluster.prefill_tokens_per_s / scale)]
    prefill += ["--prefill-overhead-ms", _flag(cluster.prefill_overhead_s * scale * 1000)]
    prefill += ["--max-batch-tokens", str(cluster.max_batch_tokens)]
    decode = ["--decode-tokens-per-s", _flag(cluster.decode_tokens_per_s / scale)]
    if settings.pd_decider == "local-when-faster":  # the decodes prefill as the prefills do
        decode += prefill
    w, ca = settings.prefix, settings.cache_aware
    gateway = ["--prefill-policy", policy, "--decode-policy", settings.decode_policy]
    gateway += ["--seed", str(settings.seed)]
    gateway += ["--prefix-uncached-weight", _flag(w.uncached_weight)]
    gateway += ["--prefix-queued-weight", _flag(w.queued_weight)]
    gateway += ["--prefix-request-cost", _flag(w.request_cost)]
    gateway += ["--prefix-pressure-weight", _flag(w.pressure_weight)]
    grace = w.pending_grace_secs
    gateway += ["--prefix-pending-grace-secs", "off" if grace is None else _flag(grace * scale)]
    gateway += ["--cache-threshold", _flag(ca.cache_threshold)]
    gateway += ["--balance-abs-threshold", str(ca.balance_abs_threshold)]
    gateway += ["--balance-rel-threshold", _flag(ca.balance_rel_threshold)]
    gateway += ["--eviction-interval-secs", _flag(ca.eviction_interval_secs)]
    gateway += ["--max-tree-size", str(ca.max_tree_size)]
    if settings.pd_decider == "local-when-faster":
        gateway += ["--pd-decider", "local-when-faster"]
        gateway += ["--pd-decider-itl-weight", _flag(settings.pd_decider_itl_weight)]
    if redis_url is not None and settings.gateway_sharing == "shared":
        gateway += ["--share-state-interval-secs", _flag(settings.share_interval_s * scale)]
    run_dir = None if settings.run_dir is None else Path(settings.run_dir) / policy
    return StackConfig(
        run_dir=run_dir,
        gateways=settings.gateways,
        entry=settings.entry,
        redis_url=redis_url,
        prefill=cluster.pods,
        decode=cluster.decode_pods,
        model=settings.model,
        block_size=cluster.block_size,
        tokenizer="byte",
        log_level="WARNING",
        prefill_args=prefill,
        decode_args=decode,
        gateway_args=gateway,
        engine=settings.engine,
    )


@dataclass(frozen=True, slots=True)
class _Answer:
    ttft: float
    done: float
    cached: int
    queue_s: float
    prefill_s: float


class LiveRequestError(RuntimeError):
    """A request the stack did not answer properly; the run records it as failed."""


def _number(meta: dict[str, Any], key: str, default: float | None = None) -> float:
    value = meta.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise LiveRequestError(f"meta_info.{key} is {value!r}, not a number >= 0")
    return float(value)


def _request(tokens: list[int], max_new_tokens: int, vllm: bool) -> tuple[str, dict[str, Any]]:
    if vllm:
        body: dict[str, Any] = {"prompt": tokens, "max_tokens": max_new_tokens, "stream": True}
        body["stream_options"] = {"include_usage": True}
        return "/v1/completions", body
    sampling = {"max_new_tokens": max_new_tokens}
    return "/generate", {"input_ids": tokens, "sampling_params": sampling, "stream": True}


def _usage_meta(chunk: dict[str, Any]) -> dict[str, Any] | None:
    """An OpenAI stream's usage chunk as `meta_info` fields, or None for another chunk."""
    usage = chunk.get("usage")
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return {"cached_tokens": cached}


async def _send(
    client: httpx.AsyncClient,
    url: str,
    tokens: list[int],
    max_new_tokens: int,
    vllm: bool = False,
) -> _Answer:
    path, body = _request(tokens, max_new_tokens, vllm)
    sent = time.perf_counter()
    first: float | None = None
    meta: dict[str, Any] = {}
    async with client.stream("POST", f"{url}{path}", json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")[:200]
            raise LiveRequestError(f"{path} answered {response.status_code}: {text}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            if first is None:
                first = time.perf_counter()
            try:
                chunk = json.loads(payload)
            except json.JSONDecodeError as exc:
                raise LiveRequestError(f"a streamed chunk is not JSON: {exc.msg}") from None
            if isinstance(chunk, dict) and isinstance(chunk.get("meta_info"), dict):
                meta = chunk["meta_info"]
            elif vllm and isinstance(chunk, dict):
                meta = _usage_meta(chunk) or meta
    if first is None or "cached_tokens" not in meta:
        raise LiveRequestError("the stream ended without a token and its meta_info")
    return _Answer(
        ttft=first - sent,
        done=time.perf_counter() - sent,
        cached=int(_number(meta, "cached_tokens")),
        queue_s=_number(meta, "queue_ms", 0.0) / 1000,
        prefill_s=_number(meta, "prefill_ms", 0.0) / 1000,
    )


async def replay_through(
    url: str | Sequence[str],
    settings: ReplaySettings,
    trace: Trace,
    policy: PolicyName,
    progress: ProgressHook | None = None,
    *,
    client: httpx.AsyncClient | None = None,
) -> RunRecord:
    """Send the trace to a running gateway (request i to the i mod G-th of several, as a
    load balancer would) at its scaled arrival times.

    `client` is the one pooled client to use (tests pass one over `httpx.MockTransport`);
    without it one is made for the run, with no connection limit: arrivals must not
    wait for a free connection.
    """
    if client is None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        timeout = httpx.Timeout(None, connect=10.0)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as owned:
            return await _replay(owned, url, settings, trace, policy, progress)
    return await _replay(client, url, settings, trace, policy, progress)


async def _replay(
    client: httpx.AsyncClient,
    url: str | Sequence[str],
    settings: ReplaySettings,
    trace: Trace,
    policy: PolicyName,
    progress: ProgressHook | None,
) -> RunRecord:
    scale = settings.time_scale
    requests = trace.requests
    arrivals = [t * scale for t in arrival_times(requests, settings.arrivals)]
    record = RunRecord.empty(policy, len(requests), scale)
    failures: list[str] = []
    started = time.perf_counter()
    urls = [url] if isinstance(url, str) else list(url)

    async def one(i: int) -> None:
        req = requests[i]
        tokens = expand(req.hash_ids, req.input_length, trace.block_size, settings.vocab)
        output = settings.output_tokens(req.output_length)
        at = arrivals[i]
        record.routed(i, at, Choice(""), tokens=len(tokens), output=output)
        delay = started + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        sent = time.perf_counter() - started
        try:
            vllm = settings.engine == "vllm"
            answer = await _send(client, urls[i % len(urls)], tokens, max(output, 1), vllm)
        except (httpx.HTTPError, LiveRequestError) as exc:
            failures.append(f"request {i}: {exc}")
            return
        record.served(
            i,
            cached=answer.cached,
            queue=answer.queue_s,
            prefill=answer.prefill_s,
            ttft=sent - at + answer.ttft,
        )
        record.decoded(i, sent + answer.done)
        if progress is not None:
            done = sum(1 for d in record.done if not math.isnan(d))
            wall = time.perf_counter() - started
            progress(Progress(policy, done, len(requests), at / scale, wall))

    await asyncio.gather(*(one(i) for i in range(len(requests))))
    if failures:
        log.warning(
            "%d of %d live requests failed; first: %s", len(failures), len(requests), failures[0]
        )
    record.failed = len(failures)
    record.close([], {}, wall_s=time.perf_counter() - started)
    return record


def _counter(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def local_share(cluster: LocalCluster) -> float | None:
    """The share of attempts the gateways prefilled on a decode, from their
    `globalkv_gateway_pd_decisions_total`; None when none was counted."""
    local = total = 0.0
    with httpx.Client(timeout=10.0) as client:
        for url in cluster.gateway_urls:
            text = client.get(f"{url}/metrics").text
            local += _counter(text, "globalkv_gateway_pd_decisions_total", decision="local")
            total += _counter(text, "globalkv_gateway_pd_decisions_total")
    return local / total if total else None


def pod_stats(cluster: LocalCluster) -> list[PodStats]:
    """Each prefill's computed and cached tokens and evictions, from its own metrics."""
    stats: list[PodStats] = []
    with httpx.Client(timeout=10.0) as client:
        for component in cluster.components:
            if component.role != "prefill":
                continue
            text = client.get(f"{component.url}/metrics").text
            stats.append(
                PodStats(
                    pod=component.pod or component.name,
                    computed_tokens=int(
                        _counter(text, "globalkv_engine_prompt_tokens_total", kind="computed")
                    ),
                    cached_tokens=int(
                        _counter(text, "globalkv_engine_prompt_tokens_total", kind="cached")
                    ),
                    evicted_blocks=int(_counter(text, "globalkv_engine_kv_cache_evictions_total")),
                )
            )
    return stats


def run_live(
    settings: ReplaySettings,
    trace: Trace,
    cluster: ResolvedCluster,
    progress: ProgressHook | None = None,
) -> dict[str, RunRecord]:
    """Every policy through its own fresh stack (empty caches, fresh index)."""
    records: dict[str, RunRecord] = {}
    for policy in settings.policies:
        with contextlib.ExitStack() as resources:
            redis_url = None
            if settings.gateways > 1 and settings.gateway_sharing == "shared":
                port = resources.enter_context(redis_server())
                redis_url = f"redis://127.0.0.1:{port}/0"
            config = stack_config(settings, cluster, policy, redis_url)
            stack = resources.enter_context(LocalCluster(config))
            record = asyncio.run(
                replay_through(stack.gateway_urls, settings, trace, policy, progress)
            )
            record.close(pod_stats(stack), {}, wall_s=record.wall_s)
            record.local_share = local_share(stack)
        records[policy] = record
    return records
