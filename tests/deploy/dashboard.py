"""The Grafana dashboard's queries, parsed by a real PromQL parser: the metrics they read,
the labels they group by and those they select on (the alert rules are read the same way)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import promql_parser

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "globalkv.json"
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$job": ".*"}
SERIES_SUFFIXES = ("_bucket", "_sum", "_count", "_total")


@dataclass(frozen=True)
class Read:
    """One metric a query reads, the labels an aggregation around it groups by, and the
    labels its selector matches on."""

    metric: str
    grouped_by: frozenset[str]
    matched: frozenset[str] = frozenset()


def load() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return dashboard


def expressions(dashboard: dict[str, Any]) -> Iterator[str]:
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield target["expr"]


def parse(expr: str) -> Any:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return promql_parser.parse(expr)


def reads(node: Any, grouped_by: frozenset[str] = frozenset()) -> Iterator[Read]:
    """Every selector under `node`, with the `by (…)` labels of the aggregations above it."""
    if isinstance(node, promql_parser.VectorSelector):
        matched = frozenset(m.name for m in node.matchers.matchers)
        yield Read(node.name, grouped_by, matched)
        return
    if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
        grouped_by = grouped_by | set(node.modifier.labels)
    children: list[Any] = []
    for attribute in ("lhs", "rhs", "expr", "vector_selector"):
        child = getattr(node, attribute, None)
        if child is not None:
            children.append(child)
    children.extend(getattr(node, "args", None) or [])
    for child in children:
        yield from reads(child, grouped_by)


def family(series: str) -> str:
    """The metric family a series name belongs to (`x_bucket` → `x`, `x_total` → `x`)."""
    for suffix in SERIES_SUFFIXES:
        if series.endswith(suffix):
            return series[: -len(suffix)]
    return series
