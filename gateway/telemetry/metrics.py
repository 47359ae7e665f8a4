"""The gateway's Prometheus metrics, in a registry owned by one app.

Counters and histograms are updated on the request path, through label children bound
once (`EndpointMetrics`) rather than looked up per request, and are the event loop's own
plain numbers (`gateway.telemetry.loop_metrics`: no lock per update); worker state (health, circuit,
directory, load) is read from the pool at scrape time by a collector, so no code has to
remember to update a gauge when state changes.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.load.tracker import LoadTracker
from gateway.telemetry.loop_metrics import Counter, CounterValue, Histogram
from gateway.workers.pool import WorkerPool
from kvplumbing.budget import BodyBudget

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TOKEN_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)


class _PoolCollector(Collector):
    def __init__(self, pool: WorkerPool, loads: LoadTracker) -> None:
        self._pool = pool
        self._loads = loads

    def collect(self) -> Iterator[Metric]:
        labels = ["worker", "role"]
        healthy = GaugeMetricFamily(
            "globalkv_gateway_worker_healthy",
            "1 when the worker passes health checks.",
            labels=labels,
        )
        eligible = GaugeMetricFamily(
            "globalkv_gateway_worker_eligible", "1 when the worker may take traffic.", labels=labels
        )
        breaker = GaugeMetricFamily(
            "globalkv_gateway_breaker_state",
            "Circuit breaker state: 0 closed, 1 open, 2 half-open.",
            labels=labels,
        )
        directory = GaugeMetricFamily(
            "globalkv_gateway_directory_ready",
            "Prefill bootstrap directory: 1 ready, 0 not ready or unreachable, -1 unknown.",
            labels=["worker", "pod"],
        )
        in_flight = GaugeMetricFamily(
            "globalkv_gateway_worker_in_flight", "Requests in flight per worker.", labels=labels
        )
        queued = GaugeMetricFamily(
            "globalkv_gateway_worker_queued_prefill_tokens",
            "Uncached prompt tokens sent to a prefill and not yet prefilled.",
            labels=labels,
        )
        remaining = GaugeMetricFamily(
            "globalkv_gateway_worker_remaining_prefill_tokens",
            "The work estimated left of the queued prefill tokens, in tokens at the worker's "
            "measured rate (what the prefix policy weighs; long contexts count for more).",
            labels=labels,
        )
        rate = GaugeMetricFamily(
            "globalkv_gateway_worker_prefill_tokens_per_second",
            "A prefill's rate as this gateway measures it: uncached tokens answered per "
            "second with prefills open (absent until one answered).",
            labels=labels,
        )
        now = self._loads.clock()
        for worker in self._pool:
            key = [worker.id, worker.role]
            load = self._loads.load(worker.id)
            healthy.add_metric(key, float(worker.health.healthy))
            eligible.add_metric(key, float(worker.eligible))
            breaker.add_metric(key, float(worker.breaker.state.gauge))
            in_flight.add_metric(key, float(load.in_flight))
            queued.add_metric(key, float(load.queued_prefill_tokens))
            remaining.add_metric(key, float(load.progress.remaining(now)))
            measured = load.progress.tokens_per_s
            if measured is not None:
                rate.add_metric(key, measured)
            if worker.role == "prefill":
                directory.add_metric([worker.id, worker.pod], float(worker.directory.status.gauge))
        pending = GaugeMetricFamily(
            "globalkv_gateway_pending_prefix_keys",
            "Block keys of prompts sent to prefills that the prefix policy counts as held "
            "there until the index shows them (bounded; see --prefix-pending-grace-secs).",
        )
        pending.add_metric([], float(self._loads.pending_keys()))
        yield from (healthy, eligible, breaker, directory, in_flight, queued, remaining, rate)
        yield pending


class _BodyCollector(Collector):
    def __init__(self, budget: BodyBudget) -> None:
        self._budget = budget

    def collect(self) -> Iterator[Metric]:
        budget = self._budget
        yield GaugeMetricFamily(
            "globalkv_gateway_request_body_bytes",
            "Request-body bytes held now, every request together (arriving, waiting or "
            "being served); at most --max-buffered-payload-size.",
            value=budget.used,
        )
        yield GaugeMetricFamily(
            "globalkv_gateway_request_body_limit_bytes",
            "--max-buffered-payload-size: past it a body is answered 503.",
            value=budget.total,
        )


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "globalkv_gateway_requests",
            "Requests answered, by endpoint and HTTP status.",
            ["endpoint", "status"],
            registry=registry,
        )
        self.latency = Histogram(
            "globalkv_gateway_request_duration_seconds",
            "Time from request to the last byte of the answer.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.ttfb = Histogram(
            "globalkv_gateway_time_to_first_byte_seconds",
            "Time from request to the first byte of the decode's answer.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.retries = Counter(
            "globalkv_gateway_retries",
            "Attempts after the first, by which side failed.",
            ["endpoint", "role"],
            registry=registry,
        )
        self.request_timeouts = Counter(
            "globalkv_gateway_request_timeouts",
            "Requests answered 504 at the request deadline, by the PD stage they were in "
            "(prefill, decode, decode_first_byte, retry_backoff).",
            ["endpoint", "stage"],
            registry=registry,
        )
        self.vllm_recomputes = Counter(
            "globalkv_gateway_vllm_recomputes",
            "vLLM decodes that computed the prompt themselves: no_params (the prefill "
            "answered without kv_transfer_params and the decode's answer reports the prompt "
            "uncached) or prefill_failed (--vllm-allow-recompute).",
            ["reason"],
            registry=registry,
        )
        self.vllm_prefilled_decodes = Counter(
            "globalkv_gateway_vllm_prefilled_decodes",
            "vLLM decodes answered after their prefill, by how the prompt's KV reached them: "
            "params (the prefill's kv_transfer_params), prompt (none; the decode's answer "
            "reports the prompt cached: its connector loaded what the prefill stored), "
            "unreported (none, and the answer does not say: a stream, or no "
            "prompt_tokens_details).",
            ["kv"],
            registry=registry,
        )
        self.pd_decisions = Counter(
            "globalkv_gateway_pd_decisions",
            "Attempts by whether they were disaggregated or prefilled on the decode (local), "
            "and why: always, faster, slower, no_lookup, no_local_decode, unmeasured, batch "
            "(--pd-decider).",
            ["decision", "reason"],
            registry=registry,
        )
        self.upstream_failures = Counter(
            "globalkv_gateway_upstream_failures",
            "Failed upstream calls, by role and reason (status code or error type).",
            ["role", "reason"],
            registry=registry,
        )
        self.decisions = Counter(
            "globalkv_gateway_routing_decisions",
            "Routing choices by role and policy; outcome hit, miss or fallback.",
            ["role", "policy", "outcome"],
            registry=registry,
        )
        self.fallbacks = Counter(
            "globalkv_gateway_routing_fallbacks",
            "Requests routed by load instead of cache: no_tokenizer, not_tokenizable, "
            "no_index, no_model, index_unavailable.",
            ["reason"],
            registry=registry,
        )
        self.chosen_hit = Histogram(
            "globalkv_gateway_chosen_hit_tokens",
            "Cached prompt tokens on the chosen prefill, per index-routed request.",
            buckets=_TOKEN_BUCKETS,
            registry=registry,
        )
        self.best_hit = Histogram(
            "globalkv_gateway_best_hit_tokens",
            "Longest cached prefix on any pod, per index-routed request.",
            buckets=_TOKEN_BUCKETS,
            registry=registry,
        )
        self.lookup_latency = Histogram(
            "globalkv_gateway_index_lookup_seconds",
            "Time of one index lookup.",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )

    def watch_pool(self, pool: WorkerPool, loads: LoadTracker) -> None:
        self.registry.register(_PoolCollector(pool, loads))

    def watch_bodies(self, budget: BodyBudget) -> None:
        self.registry.register(_BodyCollector(budget))


class EndpointMetrics:
    """One endpoint's request metrics, their label children bound once."""

    def __init__(self, metrics: GatewayMetrics, endpoint: str) -> None:
        self.latency = metrics.latency.labels(endpoint)
        self.ttfb = metrics.ttfb.labels(endpoint)
        self._requests = metrics.requests
        self._endpoint = endpoint
        self._by_status: dict[int, CounterValue] = {}

    def answered(self, status: int) -> None:
        counter = self._by_status.get(status)
        if counter is None:
            counter = self._by_status[status] = self._requests.labels(self._endpoint, str(status))
        counter.inc()
