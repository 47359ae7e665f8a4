"""Reading Prometheus metrics in assertions: a registry in this process, or a process's
/metrics."""

from __future__ import annotations

import httpx
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """The sample's value; 0.0 for one never written (a labelled child not yet created)."""
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def scrape(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` at `url`/metrics whose labels include `labels` (0 when
    the series does not exist yet): a real process's metrics, read as an operator would."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )
