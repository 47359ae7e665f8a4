"""Flow control under a noisy tenant, replayed from a trace through real processes: a
premium tenant's and an under-share tenant's time to first token, and fairness between
equal tenants, with today's FIFO admission and with `--flow-control`, side by side.

    python -m bench.flow [--seconds 420] [--warmup 15] [--reserves 1 2] [--seed 1]

Every tenant replays its own slice of a Mooncake-format trace (`bench.flow_workload`: the
bundled Mooncake conversation trace by default): the trace's arrival pattern, input
lengths and hash ids (each expanded into tokens as `bench.replay.tokens` does, so turns
of one conversation share their prefix in the engines' caches and the index), its clock
scaled so that the tenant offers its share of the cluster's capacity in prompt tokens:

- `premium`: `--premium` × capacity, objective `premium` (priority 10, TTFT `--premium-ttft`
  × the prefill time of its slice's mean prompt in the engines' model);
- `noisy`: `--noisy` × capacity; `steady`: `--steady` × capacity, more than its fair
  share once the noisy tenant is there; `light`: `--light` × capacity, less than its fair
  share; all three in the default band (no TTFT), equal tenants.

Each request goes to `/generate` with `input_ids`, `stream: true`, at most
`--max-output` new tokens, its tenant in `x-llm-d-inference-fairness-id` and, for premium,
`x-llm-d-inference-objective: premium`; its time to first token is taken from its sending
to the first streamed chunk. The engines prefill at `--prefill-tokens-per-s` in their
latency model, so times come from the model rather than from this machine's CPU, as long
as the machine keeps up (the report gives the client's lateness and the load average).

The runs, each on fresh local stacks (`globalkv.stack.cluster.LocalCluster`):

- `alone`: premium and light each alone on its own stack, with today's admission (their
  unloaded times, request by request), and, at the same time on a third stack, every
  tenant but the noisy one with flow control (`flow, reserve N, no noisy`, N the first
  of `--reserves`): what the noisy tenant's arrival is compared with;
- `fifo`: every tenant, today's admission (`--max-concurrent-requests`, `--queue-size`,
  `--queue-timeout-secs`);
- `flow`: every tenant, the same limits plus `--flow-control`, once per `--reserves`
  value of `--flow-reserve-prefills` (by default only the gateway's default).

The three stacks of `alone` run at once because together they offer less than one loaded
run does. Arrivals in the first `--warmup` seconds are sent but not counted.
`bench.flow_report` says what is reported and how.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import orjson

from bench.flow_report import Result, RunResult, against, fairness_table, tenant_table
from bench.flow_workload import Planned, Slice, Tenant, slice_tenants
from bench.replay.tokens import expand
from bench.replay.trace import BUNDLED_MOONCAKE, Trace, read_trace
from gateway.settings.flow import FlowConfig
from globalkv.stack.cluster import LocalCluster, StackConfig

FAIRNESS = "x-llm-d-inference-fairness-id"
OBJECTIVE = "x-llm-d-inference-objective"
PREMIUM, UNDER, NOISY = "premium", "light", "noisy"
EQUAL = ("noisy", "steady", "light")
QUIET = ", no noisy"
RUNS = ("alone", "fifo", "flow")


def tenants(args: argparse.Namespace) -> list[Tenant]:
    return [
        Tenant(PREMIUM, args.premium, "premium"),
        Tenant("light", args.light),
        Tenant("steady", args.steady),
        Tenant("noisy", args.noisy),
    ]


def capacity(args: argparse.Namespace) -> float:
    """Uncached prompt tokens per second the prefills compute together."""
    return float(args.prefills * args.prefill_tokens_per_s)


def ttft_ms(args: argparse.Namespace, slices: Sequence[Slice], times: float) -> int:
    """`times` × the prefill of the slices' mean prompt in the engines' model."""
    mean = sum(s.tokens for s in slices) / max(sum(len(s.requests) for s in slices), 1)
    own = mean / args.prefill_tokens_per_s + args.prefill_overhead_ms / 1000
    return round(float(own * times * 1000))


def objectives(args: argparse.Namespace, slices: Sequence[Slice]) -> list[str]:
    """`--flow-objectives`: premium's, with its TTFT, and the default band's, without."""
    premium = [s for s in slices if s.tenant.name == PREMIUM]
    return [f"premium=10/{ttft_ms(args, premium, args.premium_ttft)}", "default=0"]


def stack(
    args: argparse.Namespace, block_size: int, gateway_args: list[str], run_dir: Path | None
) -> StackConfig:
    prefill = ["--prefill-tokens-per-s", repr(args.prefill_tokens_per_s)]
    prefill += ["--prefill-overhead-ms", repr(args.prefill_overhead_ms)]
    prefill += ["--max-batch-tokens", str(args.max_batch_tokens)]
    prefill += ["--kv-capacity", str(args.kv_capacity)]
    return StackConfig(
        prefill=args.prefills,
        decode=args.decodes,
        gateway_port=0,
        redis_url=None,
        run_dir=run_dir,
        model="emulated-model",
        block_size=block_size,
        tokenizer="byte",
        log_level="WARNING",
        prefill_args=prefill,
        decode_args=["--decode-tokens-per-s", "200", "--kv-capacity", str(args.kv_capacity)],
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


def flow_args(objectives: list[str], reserve: int) -> list[str]:
    named = ["--flow-objectives", *objectives]
    return ["--flow-control", *named, "--flow-reserve-prefills", str(reserve)]


async def one(
    client: httpx.AsyncClient, url: str, planned: Planned, objective: str | None, args: Args
) -> tuple[int, float | None, int]:
    """The status and, when served, the time to the first streamed chunk and the prompt
    tokens the prefill found cached."""
    tokens = expand(planned.hash_ids, planned.input_length, args.block_size)
    new = max(1, min(planned.output_length, args.max_output))
    body = {"input_ids": tokens, "sampling_params": {"max_new_tokens": new}, "stream": True}
    headers = {FAIRNESS: planned.tenant, "content-type": "application/json"}
    if objective is not None:
        headers[OBJECTIVE] = objective
    sent = time.perf_counter()
    content = orjson.dumps(body)
    async with client.stream("POST", f"{url}/generate", content=content, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, None, 0
        first = None
        cached = 0
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            if first is None:
                first = time.perf_counter() - sent
            meta = orjson.loads(line[5:]).get("meta_info")
            if isinstance(meta, dict) and isinstance(meta.get("cached_tokens"), int):
                cached = meta["cached_tokens"]
        return 200, first, cached


class Args:
    """What a run's requests need of the command line."""

    def __init__(self, args: argparse.Namespace, block_size: int) -> None:
        self.block_size = block_size
        self.max_output = args.max_output
        self.warmup = args.warmup
        self.timeout = args.queue_timeout + 120


async def drive(url: str, slices: Sequence[Slice], args: Args) -> list[Result]:
    plan = sorted(
        ((p, s.tenant.objective) for s in slices for p in s.requests), key=lambda x: x[0].at
    )
    results: list[Result] = []
    pool = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(args.timeout, connect=10.0)
    async with httpx.AsyncClient(limits=pool, timeout=timeout) as client:
        started = time.perf_counter()

        async def send(planned: Planned, objective: str | None) -> None:
            delay = started + planned.at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            late = time.perf_counter() - started - planned.at
            try:
                status, ttft, cached = await one(client, url, planned, objective, args)
            except httpx.HTTPError:
                status, ttft, cached = None, None, 0
            counted = planned.at >= args.warmup
            results.append(
                Result(planned.tenant, planned.index, counted, status, ttft,
                       planned.input_length, cached, late)
            )  # fmt: skip

        await asyncio.gather(*(send(p, o) for p, o in plan))
    return results


Stack = tuple[str, list[str], Sequence[Slice]]
"""A run's label, its gateway's flags and the tenants it replays."""


def run(args: argparse.Namespace, block_size: int, stacks: Sequence[Stack]) -> list[RunResult]:
    """Each stack started fresh, all of them driven at once; one result per label."""
    need = Args(args, block_size)
    with contextlib.ExitStack() as clusters:
        urls = []
        for number, (label, flags, _) in enumerate(stacks):
            where = None
            if args.run_dir is not None:
                where = Path(args.run_dir) / f"{re.sub(r'[^a-z0-9]+', '-', label)}-{number}"
            config = stack(args, block_size, flags, where)
            urls.append(clusters.enter_context(LocalCluster(config)).gateway_url)
        start = os.getloadavg()[0]

        async def all_of() -> list[list[Result]]:
            drives = (drive(url, s[2], need) for url, s in zip(urls, stacks, strict=True))
            return list(await asyncio.gather(*drives))

        parts = asyncio.run(all_of())
        end = os.getloadavg()[0]
    labels = list(dict.fromkeys(label for label, _, _ in stacks))
    out = []
    for label in labels:
        results = [r for (mine, _, _), part in zip(stacks, parts, strict=True) for r in part
                   if mine == label]  # fmt: skip
        late = sorted(r.late for r in results)
        note = f"client lateness p99 {late[int(0.99 * (len(late) - 1))] * 1000:.0f} ms"
        together = [other for other in labels if other != label]
        if together:
            note += f"; at once with {', '.join(together)}"
        out.append(RunResult(label, results, args.seconds, (start, end), [note]))
    return out


def report(
    runs: Sequence[RunResult], slices: Sequence[Slice], trace: Trace, args: argparse.Namespace
) -> str:
    cap = capacity(args)
    lines = [
        f"trace {os.path.basename(trace.source)} ({len(trace.requests)} requests, blocks of "
        f"{trace.block_size}); capacity {cap:,.0f} prompt tokens/s ({args.prefills} prefills × "
        f"{args.prefill_tokens_per_s:,.0f} tokens/s + {args.prefill_overhead_ms:g} ms per "
        f"request, {args.kv_capacity} blocks of KV each), {args.decodes} decodes; "
        f"{args.seconds:g} s counted after {args.warmup:g} s; seed {args.seed}",
        f"objectives {' '.join(objectives(args, slices))} (premium's TTFT {args.premium_ttft:g} × "
        f"its mean prompt's prefill); limits: {' '.join(limits(args))}",
        "",
        "| tenant | trace requests from | requests | mean prompt | run s per trace s |",
        "|---|---|---|---|---|",
    ]
    for s in slices:
        mean = s.tokens / max(len(s.requests), 1)
        lines.append(
            f"| {s.tenant.name} | {s.first} | {len(s.requests)} | {mean:,.0f} | {s.stretch:.3f} |"
        )
    lines += ["", *tenant_table(runs, cap), ""]
    bases = [r for r in runs if r.label == "alone" or r.label.endswith(QUIET)]
    loaded = [r for r in runs if r.label != "alone"]
    lines += [*against(loaded, PREMIUM, bases[:1]), ""]
    lines += [*against(loaded, UNDER, bases), ""]
    lines += [*fairness_table(loaded, EQUAL, cap), ""]
    for r in runs:
        lines.append(
            f"- {r.label}: load average {r.load[0]:.1f} at its start, {r.load[1]:.1f} at its "
            f"end; {'; '.join(r.notes)}"
        )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    add = p.add_argument
    add("--trace", default=str(BUNDLED_MOONCAKE), help="Mooncake-format JSONL trace")
    add("--seed", type=int, default=1, help="picks where in the trace the slices start")
    add("--seconds", type=float, default=420.0, help="arrivals counted, after the warm-up")
    add("--warmup", type=float, default=15.0, help="arrivals sent but not counted")
    add("--prefills", type=int, default=4)
    add("--decodes", type=int, default=2)
    add("--prefill-tokens-per-s", type=float, default=16_000.0)
    add("--prefill-overhead-ms", type=float, default=5.0)
    add("--max-batch-tokens", type=int, default=8192, help="prefill tokens per engine step")
    add("--kv-capacity", type=int, default=1024, help="KV blocks (of the trace's size) per engine")
    add("--premium", type=float, default=0.2, help="premium's load, × capacity")
    add("--noisy", type=float, default=4.0, help="the noisy tenant's load, × capacity")
    add("--steady", type=float, default=0.4, help="steady's load, × capacity")
    add("--light", type=float, default=0.1, help="light's load, × capacity")
    add("--premium-ttft", type=float, default=1.05, help="its objective, × mean prompt prefill")
    kept = FlowConfig().reserve_prefills
    add(
        "--reserves",
        type=int,
        nargs="+",
        default=[kept],
        help="--flow-reserve-prefills of each flow run; the first also runs without noisy",
    )
    add("--max-concurrent", type=int, default=8)
    add("--queue-size", type=int, default=20)
    add("--queue-timeout", type=float, default=20.0)
    add("--max-output", type=int, default=8, help="cap on each request's new tokens")
    add("--run-dir", default=None, help="where the stacks' logs go (default: under runs/)")
    add("--runs", nargs="+", default=list(RUNS), choices=RUNS, help="which runs, in order")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    trace = read_trace(args.trace)
    duration = args.warmup + args.seconds
    slices = slice_tenants(trace, tenants(args), capacity(args), duration, args.seed)
    by_name = {s.tenant.name: s for s in slices}
    bs = trace.block_size
    fifo = limits(args)
    flow = {n: limits(args) + flow_args(objectives(args, slices), n) for n in args.reserves}
    quiet = [s for s in slices if s.tenant.name != NOISY]
    runs: list[RunResult] = []
    for label in args.runs:
        if label == "alone":
            alone: list[Stack] = [("alone", fifo, [by_name[name]]) for name in (PREMIUM, UNDER)]
            first = args.reserves[0]
            alone.append((f"flow, reserve {first}{QUIET}", flow[first], quiet))
            runs += run(args, bs, alone)
        elif label == "fifo":
            runs += run(args, bs, [("fifo", fifo, slices)])
        else:
            for n in args.reserves:
                runs += run(args, bs, [(f"flow, reserve {n}", flow[n], slices)])
    print(report(runs, slices, trace, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
