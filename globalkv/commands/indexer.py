"""`globalkv indexer`: follow engines' KV events into the index and serve the index API.

    globalkv indexer --host 0.0.0.0 --port 8100 [--redis-url redis://…] [--block-size 16]
        [--bind tcp://*:5557]... [--pod '{"id": "p0", "kv_events": {…}}']...
        [--pods-file pods.json] [--admin-token T | --insecure] [--tokenizer PATH|byte]
        [--allow-endpoint-scheme ipc|inproc]... [--allow-publisher CIDR]...
        [--discovered-idle-secs S]
        [--max-tokens N] [--max-body-bytes N] [--queue-size N] [--replay-max-bytes N]
        [--reconcile-interval S]
        [--replicas [--lease-ttl S] [--indexer-id NAME]]

Every flag also reads `GLOBALKV_INDEXER_<FLAG>`. A repeatable flag's environment value is
split at commas, which JSON pods contain: give pods through the environment with
`GLOBALKV_INDEXER_PODS_FILE` instead.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, get_args

from globalkv.api import OPEN_LOOKUPS_FLAG, ApiConfig
from globalkv.checks import tokenizer_line
from globalkv.indexer import IndexerConfig, run_indexer
from globalkv.ingest.config import ALLOW_SCHEME_FLAG, EndpointScheme, IngestConfig
from globalkv.ingest.publishers import ALLOW_PUBLISHER_FLAG
from kvplumbing.addresses import redacted
from kvplumbing.validation import validation_as_value_error


def register(subparsers: Any) -> None:
    defaults = IndexerConfig()
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "indexer",
        help="run the cluster-wide KV index: event ingest and the index HTTP API",
        description="Subscribe to engines' KV events (vLLM, SGLang) and answer which pod "
        "holds how long a prefix of a prompt.",
    )
    add = parser.add_argument
    add("--host", default=defaults.host, help="HTTP listen address")
    add("--port", type=int, default=defaults.port, help="HTTP port")
    add("--redis-url", help="keep the index and pod registry in this Redis (memory if unset)")
    add("--redis-prefix", default=defaults.redis_prefix, help="prefix of every Redis key")
    add("--block-size", type=int, default=defaults.block_size, help="tokens per index block")
    add("--max-entries", type=int, help="memory index bound in (block, source) entries")
    add(
        "--bind",
        action="append",
        default=[],
        metavar="ENDPOINT",
        help="bind a SUB here for engines that connect to the indexer (repeatable); "
        "pods are named by their kv@<pod>@<model> topic",
    )
    add("--pod", action="append", default=[], metavar="JSON", help="a pod to follow (repeatable)")
    add("--pods-file", metavar="PATH", help="a JSON list of pods to follow")
    add(
        "--admin-token",
        help="required as 'Authorization: Bearer T' on mutating endpoints (pods); without "
        "one, only loopback clients may change pods",
    )
    add(
        "--insecure",
        action="store_true",
        help="without --admin-token, let any host register and remove pods, and look up",
    )
    add(
        OPEN_LOOKUPS_FLAG,
        action="store_true",
        help="answer POST /v1/lookup from any host without a token; lookups tell which "
        "prompts the cache holds, so by default they follow the admin token (or loopback)",
    )
    add(
        ALLOW_SCHEME_FLAG,
        dest="allow_endpoint_schemes",
        action="append",
        default=[],
        choices=list(get_args(EndpointScheme)),
        help="follow pods whose KV-event endpoints have this scheme too (repeatable); "
        "only tcp:// otherwise",
    )
    add(
        ALLOW_PUBLISHER_FLAG,
        dest="allow_publishers",
        action="append",
        default=[],
        metavar="CIDR",
        help="let engines in this network publish to the bound SUB (repeatable); only "
        "loopback otherwise",
    )
    add(
        "--discovered-idle-secs",
        type=float,
        default=IngestConfig().discovered_idle_secs,
        metavar="SECONDS",
        help="forget a pod discovered on the bound SUB after this long without a message",
    )
    add("--tokenizer", metavar="PATH", help="tokenizer.json, its directory, or 'byte'")
    api = ApiConfig()
    add("--max-tokens", type=int, default=api.max_tokens, help="tokens per lookup")
    add("--max-body-bytes", type=int, default=api.max_body_bytes, help="largest request body")
    ingest = IngestConfig()
    add("--queue-size", type=int, default=ingest.queue_size, help="batches per source")
    add(
        "--max-queued-events",
        type=int,
        default=ingest.max_queued_events,
        metavar="EVENTS",
        help="decoded events queued per source (a batch alone may pass it); past it the "
        "bound socket drops and connected engines wait",
    )
    add(
        "--replay-max-bytes",
        type=int,
        default=ingest.replay_max_bytes,
        metavar="BYTES",
        help="payload bytes one replay may hold; past it the replay stops and the source is reset",
    )
    add(
        "--reconcile-interval",
        type=float,
        default=defaults.reconcile_interval,
        metavar="SECONDS",
        help="how often the pod registry is reconciled",
    )
    add(
        "--replicas",
        action="store_true",
        help="share the pods with the other indexers on the same Redis: each pod is "
        "followed by the one indexer holding its lease",
    )
    add(
        "--lease-ttl",
        type=float,
        default=defaults.lease_ttl,
        metavar="SECONDS",
        help="how long a pod's lease lasts unrenewed: the longest a pod goes unfollowed "
        "when its indexer dies",
    )
    add("--indexer-id", metavar="NAME", help="this indexer's name among replicas (host-pid)")
    parser.set_defaults(run=run, check_config=check_config)


def _pods(args: argparse.Namespace) -> list[Any]:
    raw: list[Any] = []
    for text in args.pod:
        try:
            raw.append(json.loads(text))
        except json.JSONDecodeError as exc:
            raise ValueError(f"--pod is not JSON: {exc}") from None
    if args.pods_file:
        try:
            listed = json.loads(Path(args.pods_file).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"--pods-file {args.pods_file}: {exc}") from None
        if not isinstance(listed, list):
            raise ValueError(f"--pods-file {args.pods_file} must hold a JSON list of pods")
        raw.extend(listed)
    return raw


def config_from_args(args: argparse.Namespace) -> IndexerConfig:
    """Nested parts are validated as one object, so an error names its full path
    (`pods.1.kv_events`, `api.max_tokens`)."""
    with validation_as_value_error():
        return IndexerConfig.model_validate(
            {
                "host": args.host,
                "port": args.port,
                "redis_url": args.redis_url,
                "redis_prefix": args.redis_prefix,
                "block_size": args.block_size,
                "max_entries": args.max_entries,
                "tokenizer": args.tokenizer,
                "pods": _pods(args),
                "reconcile_interval": args.reconcile_interval,
                "replicas": args.replicas,
                "lease_ttl": args.lease_ttl,
                "indexer_id": args.indexer_id,
                "api": {
                    "admin_token": args.admin_token,
                    "insecure": args.insecure,
                    "open_lookups": args.open_lookups,
                    "max_tokens": args.max_tokens,
                    "max_body_bytes": args.max_body_bytes,
                },
                "ingest": {
                    "bind": args.bind,
                    "queue_size": args.queue_size,
                    "max_queued_events": args.max_queued_events,
                    "replay_max_bytes": args.replay_max_bytes,
                    "allow_publishers": args.allow_publishers,
                    "discovered_idle_secs": args.discovered_idle_secs,
                    "allow_endpoint_schemes": args.allow_endpoint_schemes,
                },
            }
        )


def check_config(args: argparse.Namespace) -> list[str]:
    """The configuration, and the tokenizer as start-up reads it (loaded under `--check`
    only: start-up loads it right after); what they give, one line each."""
    config = config_from_args(args)
    if config.redis_url is None:
        bound = "unbounded" if config.max_entries is None else f"{config.max_entries} entries"
        index = f"memory ({bound}), block size {config.block_size}"
    else:
        index = (
            f"Redis {redacted(config.redis_url)}, key prefix {config.redis_prefix}, "
            f"block size {config.block_size}"
        )
    followed = "pods shared with the other replicas by leases" if config.replicas else "every pod"
    binds = ", ".join(config.ingest.bind) or "none"
    tokenizer = tokenizer_line(config.tokenizer, load=args.check)
    return [
        f"index: {index}",
        f"follows: {followed}; {len(config.pods)} pods given; KV events bound on: {binds}",
        f"tokenizer (text lookups): {tokenizer}",
    ]


def run(args: argparse.Namespace) -> int:
    """Called by the dispatcher once `check_config` passed."""
    return run_indexer(config_from_args(args))
