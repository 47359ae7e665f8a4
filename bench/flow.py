"""Flow control under a noisy tenant, through real processes: a premium tenant's time to
first token and equal tenants' fairness, today's FIFO admission against `--flow-control`.

    python -m bench.flow [--seconds 120] [--warmup 15] [--prefills 3] [--noisy 3.0]

Each run starts a local stack (`globalkv.stack.cluster.LocalCluster`: indexer, emulated
prefill and decode engines, the gateway) and sends, open loop, Poisson arrivals per
tenant to `/generate` with `input_ids` (fresh random ids per request: nothing cached, so
every prompt costs the same), `stream: true`, the tenant in `x-llm-d-inference-fairness-id`
and, for premium, `x-llm-d-inference-objective: premium`. The engines' prefill runs at
`--prefill-tokens-per-s` in their latency model, so the cluster's capacity,

    capacity = prefills / (prompt / prefill tokens per s + prefill overhead)   requests/s,

comes from the model, not from this machine's CPU, and offered loads are multiples of it:

- `premium`: `--premium` × capacity, objective premium (priority 10, TTFT `--premium-ttft`
  × its prefill time in the model);
- `noisy`: `--noisy` × capacity; `light-1`, `light-2`: `--light` × capacity each; all
  three in the default band, equal tenants.

Three runs: premium alone (its unloaded TTFT), then all four tenants through FIFO
admission, then through flow control, both with the same `--max-concurrent-requests`,
`--queue-size` and `--queue-timeout-secs`. Arrivals in the first `--warmup` seconds are
sent but not counted (the prefills' rates are being measured). Per run and tenant:
requests offered and served per second, refusals, TTFT p50/p99 of the served; Jain's
index over the equal tenants' served rates; premium's p99 over its unloaded p99.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from globalkv.stack.cluster import LocalCluster, StackConfig

FAIRNESS = "x-llm-d-inference-fairness-id"
OBJECTIVE = "x-llm-d-inference-objective"
EQUAL = ("noisy", "light-1", "light-2")
RUNS = ["premium alone", "fifo", "flow control"]


@dataclass
class Tenant:
    name: str
    share: float
    """Offered load, a multiple of the capacity."""
    objective: str | None = None


@dataclass
class Outcome:
    sent: int = 0
    served: int = 0
    refused: dict[int, int] = field(default_factory=dict)
    ttft: list[float] = field(default_factory=list)
    failed: int = 0


def prefill_s(args: argparse.Namespace) -> float:
    """One prompt's prefill in the engines' latency model."""
    return float(args.prompt / args.prefill_tokens_per_s + args.prefill_overhead_ms / 1000)


def capacity(args: argparse.Namespace) -> float:
    return float(args.prefills) / prefill_s(args)


def stack(args: argparse.Namespace, gateway_args: list[str]) -> StackConfig:
    prefill = ["--prefill-tokens-per-s", repr(args.prefill_tokens_per_s)]
    prefill += ["--prefill-overhead-ms", repr(args.prefill_overhead_ms)]
    prefill += ["--max-batch-tokens", str(args.prompt)]
    return StackConfig(
        prefill=args.prefills,
        decode=args.decodes,
        gateway_port=0,
        redis_url=None,
        run_dir=None,
        model="emulated-model",
        block_size=16,
        tokenizer="byte",
        log_level="WARNING",
        prefill_args=prefill,
        decode_args=["--decode-tokens-per-s", "200"],
        gateway_args=gateway_args,
    )


def limits(args: argparse.Namespace) -> list[str]:
    return [
        "--max-concurrent-requests",
        str(args.max_concurrent),
        "--queue-size",
        str(args.queue_size),
        "--queue-timeout-secs",
        repr(args.queue_timeout),
    ]


def flow_args(args: argparse.Namespace) -> list[str]:
    ttft_ms = round(prefill_s(args) * args.premium_ttft * 1000)
    objectives = ["--flow-objectives", f"premium=10/{ttft_ms}", "default=0"]
    return ["--flow-control", *objectives, "--flow-reserve-prefills", str(args.reserve)]


async def one(
    client: httpx.AsyncClient, url: str, tenant: Tenant, rng: random.Random, prompt: int
) -> tuple[int, float | None]:
    """The status and, when served, the time to the first streamed chunk."""
    ids = [rng.randrange(1, 50_000) for _ in range(prompt)]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4}, "stream": True}
    headers = {FAIRNESS: tenant.name}
    if tenant.objective is not None:
        headers[OBJECTIVE] = tenant.objective
    sent = time.perf_counter()
    async with client.stream("POST", f"{url}/generate", json=body, headers=headers) as answer:
        if answer.status_code != 200:
            await answer.aread()
            return answer.status_code, None
        first = None
        async for line in answer.aiter_lines():
            if first is None and line.startswith("data:"):
                first = time.perf_counter() - sent
        return 200, first


async def drive(
    url: str, tenants: Sequence[Tenant], args: argparse.Namespace
) -> dict[str, Outcome]:
    rate = capacity(args)
    rng = random.Random(args.seed)
    plan: list[tuple[float, Tenant]] = []
    for tenant in tenants:
        at = 0.0
        while True:
            at += rng.expovariate(tenant.share * rate)
            if at >= args.warmup + args.seconds:
                break
            plan.append((at, tenant))
    plan.sort(key=lambda item: item[0])
    outcomes = {t.name: Outcome() for t in tenants}
    limits_ = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(args.queue_timeout + 60, connect=10.0)
    async with httpx.AsyncClient(limits=limits_, timeout=timeout) as client:
        started = time.perf_counter()

        async def send(at: float, tenant: Tenant, seed: int) -> None:
            delay = started + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            counted = at >= args.warmup
            outcome = outcomes[tenant.name]
            try:
                status, ttft = await one(client, url, tenant, random.Random(seed), args.prompt)
            except httpx.HTTPError:
                if counted:
                    outcome.sent += 1
                    outcome.failed += 1
                return
            if not counted:
                return
            outcome.sent += 1
            if status == 200 and ttft is not None:
                outcome.served += 1
                outcome.ttft.append(ttft)
            else:
                outcome.refused[status] = outcome.refused.get(status, 0) + 1

        await asyncio.gather(*(send(at, t, i) for i, (at, t) in enumerate(plan)))
    return outcomes


def run(
    args: argparse.Namespace, gateway_args: list[str], tenants: Sequence[Tenant]
) -> dict[str, Outcome]:
    with LocalCluster(stack(args, gateway_args)) as cluster:
        return asyncio.run(drive(cluster.gateway_url, tenants, args))


def quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def jain(rates: Sequence[float]) -> float:
    total = sum(rates)
    squares = sum(r * r for r in rates)
    return total * total / (len(rates) * squares) if squares else float("nan")


def report(runs: dict[str, dict[str, Outcome]], args: argparse.Namespace) -> str:
    lines = [
        f"capacity {capacity(args):.2f} requests/s ({args.prefills} prefills, {args.prompt}-token "
        f"prompts at {args.prefill_tokens_per_s:g} tokens/s + {args.prefill_overhead_ms:g} ms); "
        f"{args.seconds:g} s counted after {args.warmup:g} s",
        "",
        "| run | tenant | offered/s | served/s | refused (status: count) | TTFT p50 | TTFT p99 |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, run_outcomes in runs.items():
        for name, o in run_outcomes.items():
            refused = ", ".join(f"{s}: {n}" for s, n in sorted(o.refused.items())) or "—"
            if o.failed:
                refused += f", failed: {o.failed}"
            lines.append(
                f"| {label} | {name} | {o.sent / args.seconds:.2f} | {o.served / args.seconds:.2f} "
                f"| {refused} | {quantile(o.ttft, 0.5) * 1000:.0f} ms "
                f"| {quantile(o.ttft, 0.99) * 1000:.0f} ms |"
            )
    lines.append("")
    alone = runs.get("premium alone")
    unloaded = quantile(alone["premium"].ttft, 0.99) if alone else float("nan")
    for label in (label for label in ("fifo", "flow control") if label in runs):
        outcomes = runs[label]
        fairness = jain([outcomes[n].served / args.seconds for n in EQUAL])
        p99 = quantile(outcomes["premium"].ttft, 0.99)
        lines.append(
            f"{label}: premium TTFT p99 {p99 * 1000:.0f} ms = {p99 / unloaded:.2f} × unloaded "
            f"({unloaded * 1000:.0f} ms); Jain over {', '.join(EQUAL)}: {fairness:.3f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--seconds", type=float, default=300.0, help="arrivals counted, after the warm-up")
    add("--warmup", type=float, default=20.0, help="arrivals sent but not counted")
    add("--prefills", type=int, default=4)
    add("--decodes", type=int, default=2)
    add("--prompt", type=int, default=512, help="prompt tokens of every request")
    add("--prefill-tokens-per-s", type=float, default=256.0)
    add("--prefill-overhead-ms", type=float, default=5.0)
    add("--premium", type=float, default=0.1, help="premium's load, × capacity")
    add("--noisy", type=float, default=3.0, help="the noisy tenant's load, × capacity")
    add("--light", type=float, default=0.6, help="each light tenant's load, × capacity")
    add("--premium-ttft", type=float, default=1.05, help="premium's TTFT objective, × its prefill")
    add("--reserve", type=int, default=2, help="--flow-reserve-prefills")
    add("--max-concurrent", type=int, default=8)
    add("--queue-size", type=int, default=20)
    add("--queue-timeout", type=float, default=20.0)
    add("--seed", type=int, default=7)
    add("--runs", nargs="+", default=RUNS, choices=RUNS, help="which runs, in order")
    args = parser.parse_args(argv)
    premium = Tenant("premium", args.premium, "premium")
    everyone = [premium, Tenant("noisy", args.noisy)]
    everyone += [Tenant(name, args.light) for name in EQUAL[1:]]
    plans = {
        "premium alone": (limits(args) + flow_args(args), [premium]),
        "fifo": (limits(args), everyone),
        "flow control": (limits(args) + flow_args(args), everyone),
    }
    runs = {label: run(args, *plans[label]) for label in args.runs}
    print(report(runs, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
