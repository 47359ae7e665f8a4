"""The replay's outputs: the JSON document and the Markdown tables people read.

The JSON holds the settings as given, the cluster as resolved from the trace, the trace's
own figures, the oracle lines and, per policy, the summary of `bench.replay.record`.
The Markdown repeats the settings that matter in one line so a table is never read
without the load and capacity it was measured at.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.replay.config import ReplaySettings
from bench.replay.runner import Point, Replay


def _trace_json(replay: Replay) -> dict[str, Any]:
    stats = replay.stats
    return {
        "path": replay.trace.source,
        "block_size": replay.trace.block_size,
        **asdict(stats),
        "offered_tokens_per_s": stats.offered_tokens_per_s,
    }


def _point_json(point: Point) -> dict[str, Any]:
    out: dict[str, Any] = {
        "cluster": point.cluster.model_dump(mode="json"),
        "oracle": None if point.oracle is None else asdict(point.oracle),
        "policies": point.summaries,
    }
    if point.sim_summaries:
        out["sim"] = point.sim_summaries
    return out


def to_json(replay: Replay, *, command: str | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "tool": "globalkv bench replay",
        "command": command,
        "mode": replay.settings.mode,
        "trace": _trace_json(replay),
        "settings": replay.settings.model_dump(mode="json"),
    }
    if replay.sweep is None:
        doc.update(_point_json(replay.points[0]))
    else:
        doc["sweep"] = {
            "parameter": replay.sweep.parameter,
            "points": [{"value": p.value, **_point_json(p)} for p in replay.points],
        }
    return doc


def _pct(value: float) -> str:
    return "–" if math.isnan(value) else f"{value * 100:.1f} %"


def _s(value: float) -> str:
    return "–" if math.isnan(value) else f"{value:.2f}"


def _row(cells: Iterable[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def describe_cluster(point: Point, replay: Replay) -> str:
    c, s = point.cluster, point.settings
    delay = f"{c.event_delay_s * 1000:g} ms"
    attention = (
        "linear prefill"
        if c.attention_tokens is None
        else (f"attention cost doubling at {c.attention_tokens:,.0f} tokens")
    )
    grace = s.prefix.pending_grace_secs
    return (
        f"{c.pods} prefill pods × {c.capacity_blocks:,} blocks of {c.block_size} tokens "
        f"({c.capacity_fraction * 100:.1f} % of the {replay.stats.unique_blocks:,} unique "
        f"blocks), prefill {c.prefill_tokens_per_s:,.0f} tokens/s per pod (no-cache "
        f"utilisation {c.utilisation * 100:.0f} %, {attention}), {c.decode_pods} decode pods, "
        f"index event delay {delay}, arrivals {s.arrivals}, time scale {s.time_scale:g}, "
        f"seed {s.seed}, prefix weights uncached/queued/request/pressure "
        f"{s.prefix.uncached_weight:g}/{s.prefix.queued_weight:g}/{s.prefix.request_cost:g}/"
        f"{s.prefix.pressure_weight:g}, "
        f"pending grace {'off' if grace is None else f'{grace:g} s'}{_gateways(s)}."
    )


def _gateways(s: ReplaySettings) -> str:
    if s.gateways == 1:
        return ""
    shared = (
        "sharing nothing but the index"
        if s.gateway_sharing == "none"
        else f"sharing loads and pending prompts every {s.share_interval_s:g} s"
    )
    return f", {s.gateways} gateways ({shared})"


_HEAD = (
    "policy",
    "KV hit rate (tokens)",
    "TTFT mean (s)",
    "p50",
    "p90",
    "p99",
    "throughput (out tok/s)",
    "load imbalance",
)


def _policy_cells(name: str, summary: Mapping[str, Any]) -> list[str]:
    return [
        name,
        _pct(summary["hit_rate"]),
        _s(summary["ttft_mean_s"]),
        _s(summary["ttft_p50_s"]),
        _s(summary["ttft_p90_s"]),
        _s(summary["ttft_p99_s"]),
        f"{summary['throughput_tok_s']:,.0f}",
        f"{summary['load_imbalance']:.2f}",
    ]


def _oracle_rows(point: Point, width: int) -> list[str]:
    if point.oracle is None:
        return []
    blank = [""] * (width - 2)
    o = point.oracle
    return [
        _row(["oracle: Belady/MIN, pooled capacity", _pct(o.belady), *blank]),
        _row(["oracle: one pooled LRU cache", _pct(o.pooled_lru), *blank]),
        _row(["unlimited cache", _pct(o.unlimited), *blank]),
        _row(["TTFT floor: unlimited cache, no queue", "", _s(o.ttft_floor_s), *blank[1:]]),
    ]


def ratios(point: Point) -> list[str]:
    """How `prefix` compares with the other policies and the oracles, among those that ran."""
    got = point.summaries
    lines: list[str] = []
    if "prefix" not in got:
        return lines
    prefix = got["prefix"]["ttft_mean_s"]
    for other in ("random", "least_load", "cache_aware"):
        if other in got and prefix > 0:
            theirs = got[other]["ttft_mean_s"]
            change = "lower" if prefix <= theirs else "higher"
            lines.append(
                f"mean TTFT {other} / prefix = {theirs / prefix:.2f}× "
                f"(prefix {abs(1 - prefix / theirs) * 100:.0f} % {change})"
            )
    if point.oracle is not None and "random" in got:
        lines.append(
            "mean TTFT random / TTFT floor = "
            f"{got['random']['ttft_mean_s'] / point.oracle.ttft_floor_s:.2f}× "
            "(the largest ratio any policy could reach)"
        )
    indexed, left = got["prefix"].get("hit_rate_indexed"), got["prefix"].get("left_indexed_holder")
    if indexed is not None and left is not None:
        share = left / got["prefix"]["requests"] * 100
        lines.append(
            f"prefix sent {left:,} requests ({share:.0f} %) elsewhere than the pod with the "
            f"longest indexed prefix: the index offered {indexed * 100:.1f} % of prompt tokens, "
            f"the choices counted on {got['prefix']['hit_rate_expected'] * 100:.1f} %"
        )
    if point.oracle is not None and point.oracle.belady > 0:
        hit = got["prefix"]["hit_rate"]
        lines.append(
            f"prefix hit rate = {hit / point.oracle.belady * 100:.0f} % of Belady/MIN, "
            f"{hit / point.oracle.pooled_lru * 100:.0f} % of pooled LRU"
        )
    return lines


def _point_table(point: Point) -> list[str]:
    live = bool(point.sim_summaries)
    head = [*_HEAD, "sim hit rate", "Δ hit (points)", "sim TTFT mean (s)"] if live else _HEAD
    lines = [_row(head), _row(["---"] * len(head))]
    for name, summary in point.summaries.items():
        cells = _policy_cells(name, summary)
        if live:
            sim = point.sim_summaries[name]
            delta = (summary["hit_rate"] - sim["hit_rate"]) * 100
            cells += [_pct(sim["hit_rate"]), f"{delta:+.1f}", _s(sim["ttft_mean_s"])]
        lines.append(_row(cells))
    return lines + _oracle_rows(point, len(head))


def _sweep_table(replay: Replay) -> list[str]:
    assert replay.sweep is not None
    head = [replay.sweep.parameter, "policy", "KV hit rate", "hit / Belady", "TTFT mean (s)"]
    head += ["p90", "p99", "throughput (out tok/s)"]
    lines = [_row(head), _row(["---"] * len(head))]
    for point in replay.points:
        belady = point.oracle.belady if point.oracle else math.nan
        for name, s in point.summaries.items():
            lines.append(
                _row(
                    [
                        str(point.value),
                        name,
                        _pct(s["hit_rate"]),
                        _pct(s["hit_rate"] / belady) if belady else "–",
                        _s(s["ttft_mean_s"]),
                        _s(s["ttft_p90_s"]),
                        _s(s["ttft_p99_s"]),
                        f"{s['throughput_tok_s']:,.0f}",
                    ]
                )
            )
    return lines


def markdown(replay: Replay, *, plots: Iterable[Path] = ()) -> str:
    name = Path(replay.trace.source).name
    first = replay.points[0]
    title = f"### {name}: {replay.settings.mode} mode"
    if replay.sweep is not None:
        title += f", sweep of {replay.sweep.parameter}"
    about = describe_cluster(first, replay)
    if replay.sweep is not None:
        about = f"At {replay.sweep.parameter} = {first.value} (the other points vary it): {about}"
    lines = [title, "", about, ""]
    if replay.sweep is None:
        lines += _point_table(first)
        extra = ratios(first)
        if extra:
            lines += ["", *(f"- {line}" for line in extra)]
    else:
        lines += _sweep_table(replay)
    lines += [""] + [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines).rstrip() + "\n"
