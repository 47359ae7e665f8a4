"""What `bench.flow` reports: per run and tenant what was offered, served and refused and
the time to first token, then the figures flow control is held to.

- **Percentiles** are nearest-rank. A p99 comes with its 95 % distribution-free interval
  (the order statistics a binomial count puts the true p99 between), which says how far a
  few hundred samples pin it down.
- **Per request**: every run replays the same requests at the same times, so a tenant's
  request is compared with itself alone: the ratio of its TTFT under load to its TTFT
  alone, whose median and p90 say whether typical requests were slowed, not only the tail.
- **Jain's index over shares**: a tenant offered less than its fair share cannot be served
  as much as one offered more, so Jain's index over raw served rates would measure demand.
  It is taken instead over each equal tenant's served prompt tokens per second divided by
  its max-min fair share of what its band was served in that run (water-filling: a tenant
  wanting less than an equal split gets what it wants, the rest is split among the
  others), so 1.0 means each got exactly its fair share, whatever it asked for.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Result:
    tenant: str
    index: int
    counted: bool
    """Arrived after the warm-up."""
    status: int | None
    """None: the connection failed."""
    ttft: float | None
    input_length: int
    cached: int = 0
    late: float = 0.0
    """How late the client sent it after its planned arrival."""


@dataclass(slots=True)
class RunResult:
    label: str
    results: list[Result]
    seconds: float
    load: tuple[float, float] = (math.nan, math.nan)
    """The 1-minute load average at its start and end."""
    notes: list[str] = field(default_factory=list)

    def of(self, tenant: str) -> list[Result]:
        return [r for r in self.results if r.tenant == tenant and r.counted]


def served(results: Iterable[Result]) -> list[Result]:
    return [r for r in results if r.status == 200 and r.ttft is not None]


def quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _binomial_cdf(n: int, p: float) -> list[float]:
    """P(B <= k) for k = 0..n, B ~ Binomial(n, p), 0 < p < 1 (in logs: n may be large)."""
    out: list[float] = []
    total = 0.0
    for k in range(n + 1):
        log = math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
        total += math.exp(log + k * math.log(p) + (n - k) * math.log1p(-p))
        out.append(min(total, 1.0))
    return out


def quantile_interval(
    values: Sequence[float], q: float, level: float = 0.95
) -> tuple[float, float]:
    """The order statistics x(r) <= x(s) that cover the q-quantile with probability at
    least `level` (r the highest with P(B < r) <= tail, s the lowest with P(B < s) >=
    1 - tail, B the samples below it); the upper end is infinite when too few samples lie
    above the quantile to bound it."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    ordered = sorted(values)
    tail = (1 - level) / 2
    cdf = _binomial_cdf(n, q)
    r = sum(1 for c in cdf if c <= tail)
    s = next((k + 1 for k, c in enumerate(cdf) if c >= 1 - tail), n + 1)
    low = ordered[max(r, 1) - 1]
    high = ordered[s - 1] if s <= n else math.inf
    return low, high


def jain(values: Sequence[float]) -> float:
    total = sum(values)
    squares = sum(v * v for v in values)
    return total * total / (len(values) * squares) if squares else math.nan


def fair_shares(demands: Mapping[str, float], capacity: float) -> dict[str, float]:
    """Max-min fair shares of `capacity` (water-filling over the demands)."""
    shares: dict[str, float] = {}
    left = capacity
    waiting = sorted(demands, key=lambda name: demands[name])
    while waiting:
        equal = left / len(waiting)
        name = waiting[0]
        if demands[name] <= equal:
            shares[name] = demands[name]
            left -= demands[name]
            waiting.pop(0)
        else:
            for other in waiting:
                shares[other] = equal
            break
    return shares


def tokens_per_s(results: Iterable[Result], seconds: float) -> float:
    return sum(r.input_length for r in results) / seconds


def fairness(run: RunResult, equal: Sequence[str]) -> tuple[float, dict[str, float]]:
    """Jain's index over served / fair share, and each tenant's served / fair share."""
    offered = {name: tokens_per_s(run.of(name), run.seconds) for name in equal}
    got = {name: tokens_per_s(served(run.of(name)), run.seconds) for name in equal}
    shares = fair_shares(offered, sum(got.values()))
    ratios = {name: got[name] / shares[name] if shares[name] else math.nan for name in equal}
    return jain(list(ratios.values())), ratios


def ttfts(results: Iterable[Result]) -> list[float]:
    return [r.ttft for r in served(results) if r.ttft is not None]


def paired(loaded: Iterable[Result], alone: Iterable[Result]) -> list[float]:
    """TTFT under load over TTFT alone, for each request served in both."""
    before = {r.index: r.ttft for r in served(alone) if r.ttft}
    return [r.ttft / before[r.index] for r in served(loaded) if r.ttft and r.index in before]


def ms(seconds: float) -> str:
    if math.isnan(seconds):
        return "—"
    return "∞" if math.isinf(seconds) else f"{seconds * 1000:.0f} ms"


def _refused(results: Sequence[Result]) -> str:
    counts: dict[str, int] = {}
    for r in results:
        if r.status != 200:
            key = "failed" if r.status is None else str(r.status)
            counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "—"


def tenant_table(runs: Sequence[RunResult], capacity_tokens_per_s: float) -> list[str]:
    lines = [
        "| run | tenant | offered (× capacity) | offered/s | served/s | refused (status: count) "
        "| cached | TTFT p50 | p90 | p99 (95 % interval) | n |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        names = list(dict.fromkeys(r.tenant for r in run.results))
        for name in names:
            mine = run.of(name)
            ok = served(mine)
            times = ttfts(ok)
            low, high = quantile_interval(times, 0.99)
            load = tokens_per_s(mine, run.seconds) / capacity_tokens_per_s
            prompt = sum(r.input_length for r in ok)
            cached = f"{sum(r.cached for r in ok) / prompt:.0%}" if prompt else "—"
            lines.append(
                f"| {run.label} | {name} | {load:.2f} | {len(mine) / run.seconds:.2f} "
                f"| {len(ok) / run.seconds:.2f} | {_refused(mine)} | {cached} "
                f"| {ms(quantile(times, 0.5))} | {ms(quantile(times, 0.9))} "
                f"| {ms(quantile(times, 0.99))} ({ms(low)}–{ms(high)}) | {len(times)} |"
            )
    return lines


def against(runs: Sequence[RunResult], tenant: str, baselines: Sequence[RunResult]) -> list[str]:
    """`tenant`'s TTFT in each run against each baseline run: the p50 and p99 over the
    baseline's, and per request the median and p90 of its TTFT over its baseline TTFT."""
    head = f"| run | {tenant} p50 | p99 (95 % interval) | n |"
    rule = "|---|---|---|---|"
    for base in baselines:
        head += f" ÷ {base.label}: p50, p99 | per request ÷ {base.label}: median, p90 |"
        rule += "---|---|"
    lines = [head, rule]
    for run in runs:
        times = ttfts(run.of(tenant))
        if not times:
            continue
        low, high = quantile_interval(times, 0.99)
        p50, p99 = quantile(times, 0.5), quantile(times, 0.99)
        row = f"| {run.label} | {ms(p50)} | {ms(p99)} ({ms(low)}–{ms(high)}) | {len(times)} |"
        for base in baselines:
            was = ttfts(base.of(tenant))
            row += f" {_ratio(p50, quantile(was, 0.5))}, {_ratio(p99, quantile(was, 0.99))} |"
            row += f" {_pair(paired(run.of(tenant), base.of(tenant)))} |"
        lines.append(row)
    return lines


def fairness_table(
    runs: Sequence[RunResult], equal: Sequence[str], capacity_tokens_per_s: float
) -> list[str]:
    lines = [
        "| run | Jain over served ÷ fair share | served ÷ fair share | band served (× capacity) |",
        "|---|---|---|---|",
    ]
    for run in runs:
        present = [n for n in equal if run.of(n)]
        if len(present) < 2:
            continue
        index, ratios = fairness(run, present)
        band = sum(tokens_per_s(served(run.of(n)), run.seconds) for n in present)
        each = ", ".join(f"{n} {v:.2f}" for n, v in ratios.items())
        lines.append(f"| {run.label} | {index:.3f} | {each} | {band / capacity_tokens_per_s:.2f} |")
    return lines


def _ratio(a: float, b: float) -> str:
    return "—" if math.isnan(a) or math.isnan(b) or b == 0 else f"{a / b:.2f}"


def _pair(ratios: Sequence[float]) -> str:
    if not ratios:
        return "—"
    return f"{quantile(ratios, 0.5):.2f}, {quantile(ratios, 0.9):.2f} (n {len(ratios)})"
