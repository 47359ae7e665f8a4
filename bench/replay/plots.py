"""PNG plots of a replay (matplotlib, Agg backend: no display needed).

- TTFT CDF per policy (log time axis: random's tail is two orders above the rest);
- KV hit rate over time per policy, with the oracle lines, so warm-up and drift show;
- for a sweep, mean TTFT and hit rate against the swept value.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np

from bench.replay.runner import Point, Replay


def _ttft_cdf(point: Point, title: str, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, record in point.records.items():
        ttft = np.sort(np.asarray(record.ttft, dtype=np.float64) / record.time_scale)
        ttft = ttft[~np.isnan(ttft)]
        if ttft.size:
            ax.plot(ttft, np.arange(1, ttft.size + 1) / ttft.size, label=name)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s, trace time)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _hit_rate(point: Point, title: str, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, summary in point.summaries.items():
        series = np.asarray(summary["hit_rate_over_time"], dtype=np.float64)
        if series.size:
            ax.plot(series[:, 0], series[:, 1] * 100, label=name, linewidth=1.2)
    if point.oracle is not None:
        for label, value, style in (
            ("Belady/MIN", point.oracle.belady, ":"),
            ("pooled LRU", point.oracle.pooled_lru, "--"),
        ):
            ax.axhline(value * 100, color="grey", linestyle=style, label=f"{label} (whole run)")
    ax.set_xlabel(f"trace time (s, buckets of {point.settings.bucket_s:g} s)")
    ax.set_ylabel("KV hit rate (% of prompt tokens)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _sweep(replay: Replay, title: str, path: Path) -> Path:
    assert replay.sweep is not None
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    labels = [str(p.value) for p in replay.points]
    for name in replay.settings.policies:
        left.plot(
            labels, [p.summaries[name]["ttft_mean_s"] for p in replay.points], "o-", label=name
        )
        right.plot(
            labels,
            [p.summaries[name]["hit_rate"] * 100 for p in replay.points],
            "o-",
            label=name,
        )
    if all(p.oracle is not None for p in replay.points):
        right.plot(
            labels,
            [p.oracle.belady * 100 for p in replay.points if p.oracle is not None],
            "k:",
            label="Belady/MIN",
        )
    for ax, what in ((left, "mean TTFT (s)"), (right, "KV hit rate (% of tokens)")):
        ax.set_xlabel(replay.sweep.parameter)
        ax.set_ylabel(what)
        ax.grid(True, alpha=0.3)
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(replay: Replay, stem: Path) -> list[Path]:
    """The PNGs next to `stem` (the output path without its suffix)."""
    name = Path(replay.trace.source).name
    if replay.sweep is not None:
        return [_sweep(replay, f"{name}: {replay.sweep.parameter}", Path(f"{stem}-sweep.png"))]
    point = replay.points[0]
    mode = replay.settings.mode
    return [
        _ttft_cdf(point, f"{name} ({mode}): TTFT CDF", Path(f"{stem}-ttft-cdf.png")),
        _hit_rate(point, f"{name} ({mode}): KV hit rate over time", Path(f"{stem}-hit-rate.png")),
    ]
