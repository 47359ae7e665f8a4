"""`globalkv lookup` and `globalkv pods`: ask a running indexer, print readable tables.

globalkv lookup --indexer http://127.0.0.1:8100 --model m (--tokens 1,2,3 | --text "…")
globalkv pods --indexer http://127.0.0.1:8100
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx

from kvplumbing.addresses import check_http_url


def register_lookup(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "lookup",
        help="ask an indexer which pods hold a prompt's prefix",
        description="POST /v1/lookup on a running indexer and print the pods, best first.",
    )
    parser.add_argument("--indexer", required=True, help="the indexer's URL")
    parser.add_argument("--model", required=True, help="the served model name")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--tokens", help="comma-separated token ids")
    prompt.add_argument("--text", help="text, tokenized by the indexer's tokenizer")
    parser.add_argument("--lora-name", help="LoRA adapter name")
    parser.add_argument("--cache-salt", help="cache salt")
    parser.add_argument(
        "--admin-token", help="the indexer's admin token: lookups from another host need it"
    )
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds")
    parser.set_defaults(run=run_lookup, check_config=check_lookup)


def register_pods(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "pods",
        help="list the pods an indexer follows, with their ingest freshness",
        description="GET /v1/pods on a running indexer and print one row per pod source.",
    )
    parser.add_argument("--indexer", required=True, help="the indexer's URL")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds")
    parser.set_defaults(run=run_pods, check_config=check_pods)


def _url(base: str, path: str) -> str:
    try:
        return check_http_url(base) + path
    except ValueError as exc:
        raise ValueError(f"--indexer: {exc}") from None


def lookup_body(args: argparse.Namespace) -> dict[str, object]:
    body: dict[str, object] = {"model": args.model}
    if args.tokens is not None:
        try:
            body["token_ids"] = [int(t) for t in args.tokens.split(",") if t.strip()]
        except ValueError:
            raise ValueError(f"--tokens {args.tokens!r} is not a comma-separated list") from None
    else:
        body["text"] = args.text
    if args.lora_name is not None:
        body["lora_name"] = args.lora_name
    if args.cache_salt is not None:
        body["cache_salt"] = args.cache_salt
    return body


def check_lookup(args: argparse.Namespace) -> None:
    _url(args.indexer, "/v1/lookup")
    lookup_body(args)


def check_pods(args: argparse.Namespace) -> None:
    _url(args.indexer, "/v1/pods")


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    )


def _request(
    method: str, url: str, timeout: float, body: object = None, token: str | None = None
) -> Any:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    try:
        response = httpx.request(method, url, json=body, timeout=timeout, headers=headers)
    except httpx.HTTPError as exc:
        raise RuntimeError(f"cannot reach {url}: {exc}") from None
    if response.status_code != 200:
        try:
            error = response.json()
        except ValueError:
            error = None
        # FastAPI's {"detail": ...}; anything else (a proxy's page, a JSON list) verbatim.
        detail = error.get("detail", response.text) if isinstance(error, dict) else response.text
        raise RuntimeError(f"{url} answered {response.status_code}: {detail}")
    return response.json()


def run_lookup(args: argparse.Namespace) -> int:
    try:
        url = _url(args.indexer, "/v1/lookup")
        data = _request("POST", url, args.timeout, lookup_body(args), args.admin_token)
        print(_lookup_text(data))
    except (ValueError, RuntimeError) as exc:
        print(f"globalkv lookup: {exc}", file=sys.stderr)
        return 1
    return 0


def _lookup_text(data: Any) -> str:
    try:
        head = f"block size {data['block_size']}, prompt blocks {data['blocks']}"
        if not data["pods"]:
            return f"{head}\nno pod holds any prefix of this prompt"
        rows = [
            (p["pod"], p["dp_rank"], p["hit_blocks"], p["hit_tokens"], f"{p['score']:.2f}")
            for p in data["pods"]
        ]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"the indexer's answer is not a lookup result ({exc!r})") from None
    return f"{head}\n{table(('POD', 'DP', 'HIT BLOCKS', 'HIT TOKENS', 'SCORE'), rows)}"


def _age(timestamp: float | None, now: float) -> str:
    return "-" if timestamp is None else f"{max(0.0, now - timestamp):.1f}s"


def pod_rows(pods: Sequence[dict[str, Any]], now: float) -> list[tuple[object, ...]]:
    rows: list[tuple[object, ...]] = []
    for pod in pods:
        events = pod["kv_events"]
        where = events.get("endpoint") or f"bind:{events.get('topic')}"
        state = pod.get("state") or {}
        sources = state.get("sources") or [{}]
        for source in sources:
            rows.append(
                (
                    pod["id"],
                    pod.get("model") or "-",
                    pod.get("role", "-"),
                    source.get("dp_rank", "-"),
                    where,
                    pod.get("owner") or "-",
                    "yes" if state.get("subscribed") else "no",
                    "yes" if state.get("receiving") else "no",
                    "-" if source.get("last_seq") is None else source["last_seq"],
                    _age(source.get("last_applied_at"), now),
                    source.get("resets", 0),
                    source.get("drops", 0),
                )
            )
    return rows


def run_pods(args: argparse.Namespace) -> int:
    try:
        data = _request("GET", _url(args.indexer, "/v1/pods"), args.timeout)
        print(_pods_text(data, time.time()))
    except (ValueError, RuntimeError) as exc:
        print(f"globalkv pods: {exc}", file=sys.stderr)
        return 1
    return 0


def _pods_text(data: Any, now: float) -> str:
    try:
        if not data["pods"]:
            return "no pods"
        rows = pod_rows(data["pods"], now)
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise ValueError(f"the indexer's answer is not a pod list ({exc!r})") from None
    headers = ("POD", "MODEL", "ROLE", "DP", "EVENTS", "OWNER", "SUBSCRIBED", "RECEIVING")
    return table((*headers, "LAST SEQ", "AGE", "RESETS", "DROPS"), rows)
