"""The event loop's counters and histograms expose what prometheus_client's would."""

from __future__ import annotations

from typing import Any

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gateway.telemetry import loop_metrics

BUCKETS = (0.001, 0.25, 1, 30, 2_500_000)


def _exposed(module: Any) -> list[str]:
    registry = CollectorRegistry()
    counter = module.Counter("requests", "Requests.", ["endpoint", "status"], registry=registry)
    plain = module.Counter("plain", "No labels.", registry=registry)
    histogram = module.Histogram(
        "duration_seconds", "Time.", ["endpoint"], buckets=BUCKETS, registry=registry
    )
    unlabelled = module.Histogram("hits", "Hits.", buckets=(0, 16), registry=registry)
    counter.labels("generate", 200).inc()
    counter.labels("generate", "200").inc(2)
    counter.labels("chat", 503).inc()
    plain.inc()
    for value in (0.0005, 0.001, 0.2, 1.0, 5, 100, 3_000_000):
        histogram.labels("generate").observe(value)
    unlabelled.observe(16)
    unlabelled.observe(17)
    text = generate_latest(registry).decode()
    return sorted(line for line in text.splitlines() if "_created" not in line)


def test_the_exposition_is_prometheus_clients_without_created_series() -> None:
    assert _exposed(loop_metrics) == _exposed(prometheus_client)


def test_a_wrong_number_of_label_values_is_refused() -> None:
    counter = loop_metrics.Counter("c", "C.", ["a", "b"])
    with pytest.raises(ValueError, match="takes labels"):
        counter.labels("only one")


def test_a_histograms_count_is_its_buckets_sum() -> None:
    registry = CollectorRegistry()
    histogram = loop_metrics.Histogram("h", "H.", buckets=(1, 2), registry=registry)
    histogram.observe(1.5)
    histogram.observe(9)
    assert registry.get_sample_value("h_count") == 2
    assert registry.get_sample_value("h_bucket", {"le": "+Inf"}) == 2
    assert registry.get_sample_value("h_bucket", {"le": "2.0"}) == 1
    assert registry.get_sample_value("h_sum") == 10.5
