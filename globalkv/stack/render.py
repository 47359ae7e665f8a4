"""What `globalkv up` shows a user: the component table and the requests to try first."""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from globalkv.stack.cluster import ComponentStatus
from globalkv.stack.plan import Plan

DEMO_PROMPT = (
    "globalkv routes each request to the prefill pod that already holds the longest "
    "cached prefix of its prompt, then binds prefill and decode with a bootstrap room."
)
"""Long enough for several index blocks with any tokenizer, so the lookup shows a hit."""


class _Running(Protocol):
    @property
    def gateway_url(self) -> str: ...
    @property
    def indexer_url(self) -> str: ...


def _shown(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _details(status: ComponentStatus, plan: Plan) -> str:
    component = plan.get(status.name)
    if component.events_endpoint is not None:
        return f"KV events in on {component.events_endpoint}"
    if component.bootstrap_url is not None:
        return f"pod {component.pod}, bootstrap {component.bootstrap_url}"
    if component.role == "gateway":
        return "the endpoint for clients"
    if component.role == "epp":
        return "endpoint picker: Envoy's ext_proc, /workers"
    if component.role == "sidecar":
        return f"before {component.workers[-1]}, binds it to a prefill"
    if component.role == "indexer":
        return "follows the pods whose lease it holds"
    return ""


def table(components: Sequence[ComponentStatus], plan: Plan) -> str:
    header = ("COMPONENT", "URL", "DETAILS", "PID", "LOG")
    rows = [
        (
            c.name,
            c.url,
            _details(c, plan),
            str(c.pid) if c.alive else f"exited {c.returncode}",
            _shown(c.log_path),
        )
        for c in components
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in (header, *rows)
    )


def _curl(url: str, body: object) -> str:
    return f"curl -s {url} -H 'content-type: application/json' -d {shlex.quote(json.dumps(body))}"


def curl_lines(
    cluster: _Running, model: str, *, admin_token: bool = False, diagnosed: str | None = None
) -> str:
    """`admin_token`: the cluster has one, which doctor and lookups need (it is not
    printed); `diagnosed`: what doctor reads as the gateway (the picker, behind Envoy, where
    requests, the probe's too, enter at the gateway URL)."""
    gateway, indexer = cluster.gateway_url, cluster.indexer_url
    doctor = f"python -m globalkv doctor --gateway {diagnosed or gateway} --indexer {indexer}"
    if diagnosed is not None:
        doctor += f" --entry {gateway}"
    walk = "  # walk the diagnostic path"
    if admin_token:
        doctor += " --admin-token TOKEN"
        walk += " (TOKEN: the admin token given to up)"
    chat = {"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16}
    completion = {"model": model, "prompt": DEMO_PROMPT, "max_tokens": 16}
    lookup = {"model": model, "text": DEMO_PROMPT}
    # lookups are tenants' data: an indexer with a token answers them only with it
    auth = " -H 'authorization: Bearer TOKEN'" if admin_token else ""
    return "\n".join(
        [
            "Try:",
            "  # chat through the gateway",
            f"  {_curl(f'{gateway}/v1/chat/completions', chat)}",
            "  # a completion; send it twice: the second reports cached_tokens",
            f"  {_curl(f'{gateway}/v1/completions', completion)}",
            "  # which pod holds how long a prefix of that prompt",
            f"  {_curl(f'{indexer}/v1/lookup', lookup)}{auth}",
            walk,
            f"  {doctor}",
        ]
    )
