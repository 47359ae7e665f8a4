"""The indexer's own metrics (ingest and API), registered on a registry the caller owns.

Every way an event can fail to reach the index has a counter with a reason, so an
operator can tell a lossy network (gaps, replays), a restarted engine (resets by
reason), a misconfigured engine (drops by wire reason) and a slow index (queue depth,
queue_full drops) apart. Index-side counts (lookup latency, orphans) belong to the
instrumented index wrapper, not here.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
_API_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class IngestMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.batches = Counter(
            "globalkv_ingest_batches_applied_total",
            "Publisher batches applied to the index, live or replayed.",
            ["pod"],
            registry=registry,
        )
        self.blocks_stored = Counter(
            "globalkv_ingest_blocks_stored_total",
            "Engine blocks in the stores of applied batches, a block stored again included "
            "(vLLM stores a block again when it reuses it).",
            ["pod"],
            registry=registry,
        )
        self.blocks_removed = Counter(
            "globalkv_ingest_blocks_removed_total",
            "Engine blocks removed by applied batches.",
            ["pod"],
            registry=registry,
        )
        self.skipped = Counter(
            "globalkv_ingest_events_skipped_total",
            "Engine events decoded but not turned into index events: not_for_index "
            "(unknown type, remote), group, medium, extra_keys, extra_keys_malformed. "
            "Blocks the index itself skips (orphans, partial, over capacity) are "
            "globalkv_index_skipped_blocks.",
            ["reason"],
            registry=registry,
        )
        self.dropped = Counter(
            "globalkv_ingest_dropped_total",
            "Messages dropped before the index: wire reasons (not_msgpack, bad_batch, ...), "
            "bad_frames, bad_seq, unknown_topic, not_owner, pod_limit, source_limit, "
            "bad_dp_rank, wrong_publisher (a pod's topic from an address it does not live at), "
            "queue_full, internal_error (a bug while handling a batch: logged with its "
            "traceback).",
            ["reason"],
            registry=registry,
        )
        self.refused_publishers = Counter(
            "globalkv_ingest_refused_publishers_total",
            "Connections to the bound SUB refused: the peer is neither loopback nor in a "
            "network of --allow-publisher.",
            registry=registry,
        )
        self._recovery(registry)
        self._flow(registry)

    def _recovery(self, registry: CollectorRegistry) -> None:
        """How lost events were recovered: gaps, replays, resets, resyncs after data loss."""
        self.gaps = Counter(
            "globalkv_ingest_gaps_total",
            "Seq gaps seen on a source's live stream.",
            ["pod"],
            registry=registry,
        )
        self.replays = Counter(
            "globalkv_ingest_replays_total",
            "Replay requests (a gap, a first batch past seq 0, a catch-up that found batches or "
            "failed) by outcome: complete, short, timeout, malformed, limit, no_endpoint "
            "(none configured, or one ZMQ refuses).",
            ["pod", "outcome"],
            registry=registry,
        )
        self.replayed_batches = Counter(
            "globalkv_ingest_replayed_batches_total",
            "Batches received through replay and applied.",
            ["pod"],
            registry=registry,
        )
        self.resets = Counter(
            "globalkv_ingest_resets_total",
            "Sources reset in the index: restart (seq went back), gap (replay could not "
            "fill it), data_lost (index lost its data and replay could not rebuild it), "
            "unknown (first batch while the index could not say what it held).",
            ["pod", "reason"],
            registry=registry,
        )
        self.index_unavailable = Counter(
            "globalkv_ingest_index_unavailable_total",
            "Apply attempts that found the index unreachable (the batch is held and retried).",
            registry=registry,
        )
        self.data_lost = Counter(
            "globalkv_ingest_index_data_lost_total",
            "Times the index reported it lost its data, each starting a resync of every source.",
            registry=registry,
        )
        self.resyncing = Gauge(
            "globalkv_ingest_resyncing_sources",
            "Sources still being rebuilt after the index lost its data (lookups answer 503).",
            registry=registry,
        )
        self.held = Gauge(
            "globalkv_ingest_held_sources",
            "Sources whose next batch the index refuses now (unreachable, or full): held and "
            "retried, so lookups show what the index held before it.",
            registry=registry,
        )

    def _flow(self, registry: CollectorRegistry) -> None:
        """Where batches wait and how late they become visible."""
        self.queue_depth = Gauge(
            "globalkv_ingest_queue_depth",
            "Batches received and waiting to be applied, per source.",
            ["pod", "dp_rank"],
            registry=registry,
        )
        self.lag = Histogram(
            "globalkv_ingest_apply_lag_seconds",
            "From a batch's arrival at the indexer to its effects being visible.",
            buckets=_LAG_BUCKETS,
            registry=registry,
        )
        self.fenced = Counter(
            "globalkv_ingest_fenced_writes_total",
            "Index writes refused because another indexer holds the pod's lease now.",
            ["pod"],
            registry=registry,
        )
        self.leases_held = Gauge(
            "globalkv_ingest_leases_held",
            "Pods whose lease this indexer holds (and so follows).",
            registry=registry,
        )
        self.live_indexers = Gauge(
            "globalkv_ingest_live_indexers",
            "Indexers with a live heartbeat on this Redis, as this one last saw them.",
            registry=registry,
        )
        self.displaced = Gauge(
            "globalkv_ingest_displaced",
            "1 once another live process under this indexer's id took a lease of this one's "
            "(two indexers configured with one id): this one then takes none from it.",
            registry=registry,
        )
        self.takeovers = Counter(
            "globalkv_ingest_lease_takeovers_total",
            "Leases taken from another indexer after it released or lost them.",
            registry=registry,
        )
        self.unfollowed = Histogram(
            "globalkv_ingest_unfollowed_seconds",
            "At a takeover, seconds since the previous holder last renewed the pod's lease: "
            "an upper bound on the time nobody followed it.",
            buckets=(0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 7.5, 10.0, 30.0),
            registry=registry,
        )
        self.subscribed = Gauge(
            "globalkv_ingest_subscribed_sources",
            "Sources with a live subscription (or seen on a bound socket).",
            registry=registry,
        )

    def forget_pod(self, pod: str) -> None:
        """Drop every series of `pod`: a pod discovered on the bound socket and forgotten
        must not leave series behind, or each new name would cost some for good."""
        for metric in (
            self.batches,
            self.blocks_stored,
            self.blocks_removed,
            self.gaps,
            self.replays,
            self.replayed_batches,
            self.resets,
            self.queue_depth,
            self.fenced,
        ):
            metric.remove_by_labels({"pod": pod})


class ApiMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "globalkv_api_requests_total",
            "Index API requests by route and status code.",
            ["route", "status"],
            registry=registry,
        )
        self.lookup_seconds = Histogram(
            "globalkv_api_lookup_seconds",
            "POST /v1/lookup handling time, tokenization and keying included.",
            buckets=_API_BUCKETS,
            registry=registry,
        )
