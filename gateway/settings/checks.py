"""What `globalkv --check` verifies of a gateway, endpoint picker or sidecar beyond its
flags, and what it says the configuration gives.

Each of these failed only once started, and then after the process had come up: a
tokenizer that does not load, a worker file that is missing or refused, Kubernetes
discovery with no credentials or without its extra, traces without theirs, a Redis URL its
client cannot read. The dispatcher runs the check before every start too, so a start ends
on them at once, with one line. Loading the tokenizer waits for an explicit `--check`:
start-up loads it right after, and a large one should not be read twice.

What the configuration gives is said plainly, because a valid line can still route
nothing by cache: the prefix policy with no index or no tokenizer routes by load, and
discovery with no selector follows no pod.
"""

from __future__ import annotations

from pathlib import Path

from gateway.settings.config import GatewayConfig
from globalkv.checks import kubernetes_credentials, tokenizer_line
from globalkv.discovery.files import parse_workers
from globalkv.extras import require
from globalkv.redis_client import check_url
from kvplumbing.addresses import redacted


def check_gateway(config: GatewayConfig, *, load_tokenizer: bool) -> list[str]:
    """What `config` gives, one line per part; ValueError (or `MissingExtra`) for what
    would stop it starting here."""
    tokenizer = tokenizer_line(config.tokenizer, load=load_tokenizer)
    if config.tokenizer is None:
        tokenizer += f": {_WITHOUT_TOKENIZER.get(config.prefill_policy, 'this policy reads none')}"
    lines = [
        f"prefill policy: {_prefill_policy(config)}",
        f"decode policy: {config.decode_policy}",
        f"index: {_index(config)}",
        f"tokenizer: {tokenizer}",
        f"model: {config.model or 'as the request names it, else as the prefills serve it'}",
        f"workers: {len(config.prefill)} prefill and {len(config.decode)} decode given",
        f"discovery: {_discovery(config)}",
        f"admission: {_admission(config)}",
    ]
    endpoint = config.traces_endpoint
    if endpoint is not None:
        require("the gateway's OpenTelemetry traces", "otel", "opentelemetry.sdk")
        lines.append(f"traces: OTLP to {redacted(endpoint)}")
    return lines


_WITHOUT_TOKENIZER = {
    "prefix": "text and chat prompts are routed by load",
    "cache_aware": "prompts are keyed by their characters",
}


def _prefill_policy(config: GatewayConfig) -> str:
    policy = config.prefill_policy
    if policy == "cache_aware":
        return (
            "cache_aware: by the prompts this process routed (tokens with a tokenizer, "
            "else characters); the index is not read"
        )
    if policy != "prefix":
        return f"{policy}: by load, not by cache"
    if config.redis_url is None and config.indexer_url is None:
        return "prefix, but no index (--redis-url or --indexer-url): by load"
    if config.tokenizer is None:
        return (
            "prefix for requests carrying input_ids; text and chat prompts by load (no --tokenizer)"
        )
    return "prefix: the prefill holding the longest cached prefix, weighed against its load"


def _admission(config: GatewayConfig) -> str:
    """What holds a request back: nothing, the FIFO limits, or flow control (which holds
    nothing without a limit or an objective with a TTFT, said so)."""
    limits, flow = config.admission, config.flow
    limit = limits.max_concurrent_requests
    bounds = [f"{limit} at once"] if limit > 0 else []
    if limit > 0 and limits.rate_limit_tokens_per_second is not None:
        bounds.append(f"{limits.rate_limit_tokens_per_second:g} started per second")
    if not flow.enabled:
        if not bounds:
            return "none"
        return f"first come first served, {', '.join(bounds)}"
    timed = [o.name for o in flow.objectives if o.ttft_ms is not None]
    if timed:
        bounds.append(f"the prefills' headroom for {', '.join(timed)}")
    held = ", ".join(bounds) or (
        "nothing but a request's own TTFT header (no --max-concurrent-requests and no "
        "objective with a TTFT)"
    )
    bands = len({o.priority for o in flow.objectives} | {0})
    plural = "s" if bands > 1 else ""
    return f"flow control, {bands} priority band{plural}, tenants by usage; held by {held}"


def _index(config: GatewayConfig) -> str:
    if config.redis_url is not None:
        try:
            check_url(config.redis_url)
        except ValueError as exc:
            raise ValueError(f"--redis-url: {exc}") from None
        shared = config.share_state_interval_secs
        return (
            f"Redis {redacted(config.redis_url)}, key prefix {config.redis_prefix}, block size "
            f"{config.block_size}"
            + ("" if shared is None else f"; loads shared with other replicas every {shared:g} s")
        )
    if config.indexer_url is not None:
        token = "with" if config.indexer_token else "without"
        return f"the indexer at {redacted(config.indexer_url)} ({token} its token)"
    return "none"


def _discovery(config: GatewayConfig) -> str:
    discovery = config.discovery
    if discovery.worker_file is not None:
        path = Path(discovery.worker_file)
        try:
            workers = parse_workers(path.read_text(), as_json=path.suffix.lower() == ".json")
        except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
            raise ValueError(f"--worker-file {path}: {exc}") from None
        prefills = sum(w.role == "prefill" for w in workers)
        return (
            f"the file {path}, read again as it changes; it lists {prefills} prefill and "
            f"{len(workers) - prefills} decode now"
        )
    if not discovery.service_discovery:
        return "none: the workers given, and those added through POST /workers"
    credentials = kubernetes_credentials()
    where = discovery.namespace or "every namespace (needs a ClusterRole)"
    roles = [
        f"{role} pods labelled {','.join(selector)} on port {port}"
        for role, selector, port in (
            ("prefill", discovery.prefill_selector, discovery.port),
            ("decode", discovery.decode_selector, discovery.decode_port or discovery.port),
        )
        if selector
    ]
    return f"Kubernetes, in {where}: {'; '.join(roles)}; through {credentials}"
