"""Prometheus metrics of one directory, in a registry owned by its app.

Request outcomes are counters bumped by the handlers; the table's own state (readiness,
ranks, room entries, evictions) is read at scrape time by a collector, so there is one
source of truth and nothing to keep in step.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from bootstrap.table import Directory, RoomTable

REGISTRATION_OUTCOMES = ("new", "moved", "refreshed", "refused", "invalid")
"""new coordinate, known coordinate at a new address, same address again, contradicts the
topology (400), malformed body (4xx)."""

LOOKUP_OUTCOMES = {
    "snapshot": ("ok", "not_ready"),
    "rank": ("ok", "not_ready", "not_found"),
    "malformed": ("bad_request",),
}
"""GET /route answers by kind; every `not_ready` is a 503."""


class DirectoryMetrics:
    def __init__(self, registry: CollectorRegistry, directory: Directory, rooms: RoomTable) -> None:
        self.registrations = Counter(
            "globalkv_bootstrap_registrations",
            "PUT /route requests by outcome",
            ["outcome"],
            registry=registry,
        )
        self.lookups = Counter(
            "globalkv_bootstrap_lookups",
            "GET /route answers by kind (snapshot = four -1, rank) and outcome; "
            "not_ready answers are the 503s",
            ["kind", "outcome"],
            registry=registry,
        )
        self.room_requests = Counter(
            "globalkv_bootstrap_room_requests",
            "POST /register_dp_rank and /query_dp_ranks requests by outcome",
            ["endpoint", "outcome"],
            registry=registry,
        )
        self.rooms_queried = Counter(
            "globalkv_bootstrap_rooms_queried",
            "Rooms asked for in /query_dp_ranks, by whether their dp rank was known",
            ["result"],
            registry=registry,
        )
        for outcome in REGISTRATION_OUTCOMES:
            self.registrations.labels(outcome)
        for kind, outcomes in LOOKUP_OUTCOMES.items():
            for outcome in outcomes:
                self.lookups.labels(kind, outcome)
        for endpoint in ("register_dp_rank", "query_dp_ranks"):
            for outcome in ("ok", "invalid"):
                self.room_requests.labels(endpoint, outcome)
        for result in ("found", "unknown"):
            self.rooms_queried.labels(result)
        registry.register(_TableCollector(directory, rooms))


class _TableCollector(Collector):
    def __init__(self, directory: Directory, rooms: RoomTable) -> None:
        self._directory = directory
        self._rooms = rooms

    def collect(self) -> Iterator[Metric]:
        directory, rooms = self._directory, self._rooms
        yield GaugeMetricFamily(
            "globalkv_bootstrap_ready",
            "1 when every dp*cp*tp*pp coordinate is registered",
            value=float(directory.ready),
        )
        yield GaugeMetricFamily(
            "globalkv_bootstrap_registered_ranks",
            "Distinct coordinates registered",
            value=directory.registered,
        )
        yield GaugeMetricFamily(
            "globalkv_bootstrap_expected_ranks",
            "dp*cp*tp*pp of the established topology (0 before the first registration)",
            value=directory.expected or 0,
        )
        yield GaugeMetricFamily(
            "globalkv_bootstrap_room_entries",
            "room -> dp_rank entries held",
            value=len(rooms),
        )
        yield CounterMetricFamily(
            "globalkv_bootstrap_room_evictions",
            "Room entries dropped before their TTL because the table was full",
            value=rooms.evicted,
        )
        yield CounterMetricFamily(
            "globalkv_bootstrap_room_expirations",
            "Room entries dropped when their TTL passed",
            value=rooms.expired,
        )
