"""Prometheus metrics of one emulated engine, on a registry owned by the engine (never global).

Every PD failure is counted by the stage that failed, so a dashboard shows where a
disaggregated request breaks (register, topology, rank, connect, transfer, room, consume),
and the room check's two outcomes are counted apart as SGLang's logs tell them apart.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "globalkv_engine_requests_total",
            "Requests by endpoint and outcome: ok, error, or cancelled (the client left "
            "before the whole answer).",
            ["endpoint", "outcome"],
            registry=registry,
        )
        self.failures = Counter(
            "globalkv_engine_request_failures_total",
            "Failed prompts by the stage that failed.",
            ["stage"],
            registry=registry,
        )
        self.recomputed = Counter(
            "globalkv_engine_vllm_recomputed_prompts_total",
            "vLLM decode: prompts computed here because the request had no prefill's "
            "kv_transfer_params to pull.",
            registry=registry,
        )
        self.room_check_failures = Counter(
            "globalkv_engine_room_check_failures_total",
            "KV metadata rejected by the decode: not_ready (room 0) or mismatch.",
            ["reason"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "globalkv_engine_prompt_tokens_total",
            "Prompt tokens prefilled, by whether they were computed or served from cache.",
            ["kind"],
            registry=registry,
        )
        self.generated_tokens = Counter(
            "globalkv_engine_generated_tokens_total",
            "Output tokens produced.",
            registry=registry,
        )
        self._timing(registry)
        self._load_and_cache(registry)
        self._events_and_transfers(registry)

    def _timing(self, registry: CollectorRegistry) -> None:
        """How long each step of a prompt took, the PD stages included."""
        self.queue_seconds = Histogram(
            "globalkv_engine_queue_seconds",
            "Time a prompt waited for its first prefill step.",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.prefill_seconds = Histogram(
            "globalkv_engine_prefill_seconds",
            "Time from a prompt's first prefill step to its last.",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.stage_seconds = Histogram(
            "globalkv_engine_pd_stage_seconds",
            "Duration of each stage of a disaggregated request on the decode.",
            ["stage"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )

    def _load_and_cache(self, registry: CollectorRegistry) -> None:
        """What the engine holds now: work waiting, prompts running, pages cached."""
        self.queued_prefill_tokens = Gauge(
            "globalkv_engine_queued_prefill_tokens",
            "Prompt tokens left to prefill per DP rank (waiting requests: uncached on arrival).",
            ["dp_rank"],
            registry=registry,
        )
        self.running_requests = Gauge(
            "globalkv_engine_running_requests",
            "Prompts in flight.",
            registry=registry,
        )
        self.cache_pages = Gauge(
            "globalkv_engine_kv_cache_pages",
            "Pages held by the prefix cache, per DP rank.",
            ["dp_rank"],
            registry=registry,
        )
        self.cache_evictions = Counter(
            "globalkv_engine_kv_cache_evictions_total",
            "Pages evicted from the prefix cache, per DP rank.",
            ["dp_rank"],
            registry=registry,
        )

    def _events_and_transfers(self, registry: CollectorRegistry) -> None:
        """The KV-event stream, its replays and the handshake's dropped messages."""
        self.event_batches = Counter(
            "globalkv_engine_kv_event_batches_total",
            "KV-event batches by outcome: sent, or dropped by fault injection (still replayable).",
            ["dp_rank", "outcome"],
            registry=registry,
        )
        self.events = Counter(
            "globalkv_engine_kv_events_total",
            "KV events published, by type.",
            ["dp_rank", "type"],
            registry=registry,
        )
        self.replay_requests = Counter(
            "globalkv_engine_kv_replay_requests_total",
            "Replay requests by outcome (served, malformed).",
            ["dp_rank", "outcome"],
            registry=registry,
        )
        self.replayed_batches = Counter(
            "globalkv_engine_kv_replayed_batches_total",
            "Batches sent in answer to replay requests.",
            ["dp_rank"],
            registry=registry,
        )
        self.transfer_dropped = Counter(
            "globalkv_engine_transfer_messages_dropped_total",
            "Handshake messages dropped because they were malformed or unexpected.",
            ["reason"],
            registry=registry,
        )
        self.faults = Counter(
            "globalkv_engine_faults_injected_total",
            "Faults injected by the --fault-* flags, by kind.",
            ["kind"],
            registry=registry,
        )
