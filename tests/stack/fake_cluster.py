"""A whole cluster behind one `httpx.MockTransport`, with knobs to break each stage.

One prefill (with its bootstrap directory and one rank) and one decode (and, when asked,
a vLLM pool of one prefill and one decode beside them), a gateway and an indexer,
answering what `doctor` reads: the gateway's /health, /workers, /metrics, /generate and
/v1/completions; the engines' /health; the directory's /v1/directory and /route; the
indexer's /health, /v1/pods and /v1/lookup. Probes move the gateway's counters and the
indexer's applied batches the way the real components do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx

GATEWAY = "http://gw.test:30000"
INDEXER = "http://ix.test:8100"
PREFILL = "http://p0.test:30000"
DIRECTORY = "http://p0.test:8998"
DECODE = "http://d0.test:30000"
VLLM_PREFILL = "http://vp0.test:8000"
VLLM_DECODE = "http://vd0.test:8000"
VLLM_MODEL = "mv"
RANK = ("10.0.0.1", 40000)
MODEL = "m"
TIMINGS = {"register": 1.5, "rank": 0.5, "connect": 2.0, "transfer": 10.0, "room": 0.1}
SETTINGS = {
    "index": "indexer",
    "indexer_url": INDEXER,
    "tokenizer": "byte",
    "tokenizer_loaded": True,
    "model_in_use": MODEL,
}
"""The gateway's /v1/config besides its prefill policy, when all is well."""


@dataclass
class FakeCluster:
    dead: set[str] = field(default_factory=set)
    """Base URLs whose connections fail."""
    unreachable_ranks: set[tuple[str, int]] = field(default_factory=set)
    directory_ready: bool = True
    decode_eligible: bool = True
    decode_last_error: tuple[str, float] | None = None
    """(message, age in seconds) the gateway reports for the decode."""
    decode_error_step: str = "call"
    decode_discovered: bool = True
    policy: str = "prefix"
    fallback: str | None = None
    """A routing fallback reason each probe counts, or None."""
    probe_error: tuple[int, str | None, str] | None = None
    """(status, engine stage, message) the probe gets instead of an answer."""
    cached_on_repeat: bool = True
    events_flow: bool = True
    index_status: int = 200
    subscribed: bool = True
    resets: int = 0
    retries_per_probe: int = 0
    index_tokenizer: bool = True
    settings: dict[str, Any] | None = field(default_factory=lambda: dict(SETTINGS))
    """What the gateway's /v1/config shows besides the policy; None: it has no /v1/config."""
    counters: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)
    applied: int = 3
    probes: int = 0
    seen: list[str] = field(default_factory=list)
    authorized: set[str] = field(default_factory=set)
    """Base URLs that received an Authorization header."""
    gateway_token: str | None = None
    """When set, the gateway's admin reads need `Bearer <it>`, as with --admin-token."""
    vllm_pool: bool = False
    """The gateway also pairs a vLLM prefill and decode serving VLLM_MODEL."""
    completions: list[dict[str, Any]] = field(default_factory=list)
    """The bodies of the /v1/completions the gateway answered."""

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def connect(self, host: str, port: int, timeout: float) -> str | None:
        return "ConnectionRefusedError" if (host, port) in self.unreachable_ranks else None

    # ------------------------------------------------------------------ routing

    def handle(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        base = f"{url.scheme}://{url.host}:{url.port}"
        self.seen.append(f"{request.method} {base}{url.path}")
        if "authorization" in request.headers:
            self.authorized.add(base)
        if base in self.dead:
            raise httpx.ConnectError("All connection attempts failed", request=request)
        routes = {
            GATEWAY: self._gateway,
            INDEXER: self._indexer,
            DIRECTORY: self._directory,
        }
        if base in routes:
            return routes[base](request)
        if url.path == "/health":
            return httpx.Response(200)
        return httpx.Response(404)

    # ------------------------------------------------------------------ gateway

    def workers(self) -> list[dict[str, Any]]:
        return self._sglang_workers() + (self._vllm_workers() if self.vllm_pool else [])

    def _vllm_workers(self) -> list[dict[str, Any]]:
        common = {"eligible": True, "health": "healthy", "circuit": "closed", "kind": "vllm"}
        common |= {"consecutive_failures": 0, "in_flight": 0, "served_model": VLLM_MODEL}
        prefill = {"id": "vp0.test:8000", "url": VLLM_PREFILL, "role": "prefill", "pod": "vp0"}
        decode = {"id": "vd0.test:8000", "url": VLLM_DECODE, "role": "decode"}
        return [prefill | common, decode | common]

    def _sglang_workers(self) -> list[dict[str, Any]]:
        return [
            {
                "id": "p0.test:30000",
                "url": PREFILL,
                "role": "prefill",
                "eligible": self.directory_ready,
                "health": "healthy",
                "circuit": "closed",
                "consecutive_failures": 0,
                "in_flight": 0,
                "pod": "p0",
                "bootstrap_host": "p0.test",
                "bootstrap_port": 8998,
                "directory": "ready" if self.directory_ready else "not_ready",
                "directory_port": 8998,
                "registered_pod": "p0",
                "served_model": MODEL,
            },
            {
                "id": "d0.test:30000",
                "url": DECODE,
                "role": "decode",
                "eligible": self.decode_eligible,
                "health": "healthy" if self.decode_eligible else "unhealthy",
                "circuit": "closed",
                "consecutive_failures": 0 if self.decode_eligible else 3,
                "in_flight": 0,
                "last_error": self.decode_last_error and self.decode_last_error[0],
                "last_error_age_secs": self.decode_last_error and self.decode_last_error[1],
                "last_error_step": self.decode_last_error and self.decode_error_step,
                "discovered": self.decode_discovered,
            },
        ]

    def count(self, name: str, value: float = 1.0, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        self.counters[key] = self.counters.get(key, 0.0) + value

    def metrics_text(self) -> str:
        lines = []
        for (name, labels), value in sorted(self.counters.items()):
            shown = ",".join(f'{k}="{v}"' for k, v in labels)
            lines.append(f"# TYPE {name} counter")
            lines.append(f"{name}_total{{{shown}}} {value}")
        return "\n".join(lines) + "\n"

    def _gateway(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        admin_read = path in ("/workers", "/v1/config")
        expected = f"Bearer {self.gateway_token}"
        if admin_read and self.gateway_token and request.headers.get("authorization") != expected:
            error = {"message": "missing or wrong token", "type": "auth_error"}
            return httpx.Response(401, json={"error": error})
        if path == "/workers":
            return httpx.Response(200, json={"workers": self.workers()})
        if path == "/v1/config" and self.settings is not None:
            return httpx.Response(200, json={"prefill_policy": self.policy, **self.settings})
        if path == "/metrics":
            return httpx.Response(200, text=self.metrics_text())
        if path == "/generate":
            return self._probe(json.loads(request.content))
        if path == "/v1/completions" and self.vllm_pool:
            return self._completion(json.loads(request.content))
        return httpx.Response(404)

    def _completion(self, body: dict[str, Any]) -> httpx.Response:
        repeat = bool(self.completions)
        self.completions.append(body)
        self.count("globalkv_gateway_routing_decisions", role="prefill", policy=self.policy)
        prompt = len(body["prompt"]) + 1
        cached = (prompt // 16) * 16 if repeat else 0
        usage = {"prompt_tokens": prompt, "prompt_tokens_details": {"cached_tokens": cached}}
        return httpx.Response(200, json={"choices": [{"text": "abcd"}], "usage": usage})

    def _probe(self, body: dict[str, Any]) -> httpx.Response:
        repeat = self.probes > 0
        self.probes += 1
        if self.retries_per_probe:
            self.count("globalkv_gateway_retries", self.retries_per_probe, role="decode")
        if self.fallback is not None:
            self.count("globalkv_gateway_routing_fallbacks", reason=self.fallback)
            self.count("globalkv_gateway_routing_decisions", role="prefill", outcome="fallback")
        else:
            outcome = "hit" if repeat and self.cached_on_repeat else "miss"
            self.count(
                "globalkv_gateway_routing_decisions",
                role="prefill",
                policy=self.policy,
                outcome=outcome,
            )
        if self.probe_error is not None:
            status, stage, message = self.probe_error
            error: dict[str, Any] = {"message": message, "type": "x", "code": status}
            if stage is not None:
                error["stage"] = stage
            return httpx.Response(status, json={"error": error})
        if self.events_flow:
            self.applied += 1
        prompt = len(body["text"]) + 1
        cached = (prompt // 16) * 16 if repeat and self.cached_on_repeat else 0
        meta = {
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "completion_tokens": 4,
            "prefill_dp_rank": 0,
            "pd_stages_ms": {**TIMINGS, "consume": 3.0},
        }
        return httpx.Response(200, json={"text": "abcd", "meta_info": meta})

    # ------------------------------------------------------------------ directory

    def _directory(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        topology = {
            "attn_tp_size": 1,
            "attn_cp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "page_size": 16,
            "kv_cache_dtype": "auto",
            "follow_bootstrap_room": True,
        }
        if path == "/v1/directory":
            return httpx.Response(
                200,
                json={
                    "ready": self.directory_ready,
                    "topology": topology,
                    "registered": 1 if self.directory_ready else 0,
                    "expected": 1,
                    "missing": [] if self.directory_ready else [[0, 0, 0, 0]],
                },
            )
        if path == "/route":
            if not self.directory_ready:
                return httpx.Response(503, text="Prefill server not fully registered yet")
            return httpx.Response(200, json={"rank_ip": RANK[0], "rank_port": RANK[1]})
        return httpx.Response(404)

    # ------------------------------------------------------------------ indexer

    def _indexer(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/health":
            status = "ok" if self.index_status == 200 else "resyncing"
            return httpx.Response(self.index_status, json={"status": status, "pods": 1})
        if path == "/v1/pods":
            pods = [self._pod()]
            if self.vllm_pool:
                pods.append(self._pod() | {"id": "vp0", "model": VLLM_MODEL, "url": VLLM_PREFILL})
            return httpx.Response(200, json={"pods": pods})
        if path == "/v1/lookup":
            body = json.loads(request.content)
            if "text" in body and not self.index_tokenizer:
                return httpx.Response(400, json={"detail": "no tokenizer is configured"})
            return httpx.Response(200, json={"block_size": 16, "blocks": 4, "pods": []})
        return httpx.Response(404)

    def _pod(self) -> dict[str, Any]:
        return {
            "id": "p0",
            "model": MODEL,
            "block_size": 16,
            "url": PREFILL,
            "bootstrap_host": "p0.test",
            "bootstrap_port": 8998,
            "dp_size": 1,
            "kv_events": {"endpoint": "tcp://p0.test:5557", "topic": "", "mode": "connect"},
            "state": {
                "subscribed": self.subscribed,
                "resyncing": self.index_status == 503,
                "sources": [
                    {
                        "dp_rank": 0,
                        "last_seq": self.applied - 1,
                        "last_event_ts": 100.0,
                        "last_applied_at": 1000.0,
                        "applied": self.applied,
                        "resets": self.resets,
                        "drops": 0,
                        "queue_depth": 0,
                    }
                ],
                "updated_at": 1000.0,
            },
        }
