"""Shared-prefix workloads as Mooncake traces: llm-d's benchmark and two that stress placement.

Each workload is groups of prompts sharing a system prefix, each prompt its own question
after it. Block ids follow Mooncake's convention (an id names a block and everything
before it), so `bench replay` reads the output as a trace.

- `llmd73`: llm-d's 73-capacity benchmark (llm-d-kv-cache-manager, benchmarking/
  73-capacity), as inference-perf's `shared_prefix` data drives it: 150 groups × 5
  prompts of 6,000 system and 1,200 question tokens, shuffled once and sent in that order
  over and over, at Poisson rates that step up from 3 to 60 requests/s over 17 stages
  (17,144 requests in 502 s). The llm-d figures of `docs/routing-quality.md` replay it.

The two placement workloads pick a group by popularity (Zipf, exponent `skew`) and a
prompt of it uniformly, and arrive as one Poisson process:

- `small-groups`: many groups of short prompts and a cluster that could hold them all.
  Every group fits on any pod with room to spare, so what matters is that a new group
  goes where it evicts nothing wanted and that a group's prompts do not end up copied
  onto several pods: the case where placing by queue alone scatters prefixes.
- `large-groups`: a few groups of long prompts, the most popular one more than a pod can
  compute, in caches that hold a fraction of them. A group must spread over pods, and
  each copy of its prefix evicts another group's: the case where the pressure cost must
  not keep a hot group on a pod it overloads.

- `long-cold`: prompts of 12,000 tokens that share nothing: where disaggregating always
  pays (a decode that prefilled one would hold up its running decodes for seconds).
- `chat-short`: conversations of short prompts (0.3-1.3 k tokens) over four turns, each
  turn's prompt its conversation so far: where the move from prefill to decode can cost
  more than it saves, since the decode that served the last turn holds most of the next.

    python -m bench.replay.generate llmd73 -o /tmp/llmd73.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from random import Random
from typing import TextIO


@dataclass(frozen=True, slots=True)
class Workload:
    groups: int
    prompts_per_group: int
    system_tokens: int
    question_tokens: int
    output_tokens: int
    requests: int
    rate_per_s: float
    skew: float
    """Zipf exponent of the groups' popularity; 0: all equally popular."""
    block_size: int = 64


@dataclass(frozen=True, slots=True)
class StagedWorkload:
    """Prompts shuffled once and cycled, at a Poisson rate that steps up stage by stage."""

    groups: int
    prompts_per_group: int
    system_tokens: int
    question_tokens: int
    output_tokens: int
    stages: tuple[tuple[float, float], ...]
    """(requests/s, seconds) of each stage, in order."""
    block_size: int = 64


LLMD73 = StagedWorkload(
    groups=150,
    prompts_per_group=5,
    system_tokens=6000,
    question_tokens=1200,
    output_tokens=1000,
    stages=(
        (15, 50),
        (3, 20),
        (10, 20),
        (15, 20),
        (20, 38),
        (22, 34),
        (25, 30),
        (30, 25),
        (35, 21),
        (40, 38),
        (43, 36),
        (46, 33),
        (49, 30),
        (52, 29),
        (55, 27),
        (57, 26),
        (60, 25),
    ),
)
"""The stages are llm-d's: a 50 s warm-up at 15/s, then 3 to 60/s."""


@dataclass(frozen=True, slots=True)
class ChatWorkload:
    """Multi-turn conversations of short prompts: each turn's prompt is the system prompt,
    the turns before it (questions and answers) and a new question."""

    conversations: int
    turns: int
    system_tokens: int
    question_tokens: tuple[int, int]
    """The fewest and most tokens of a question, drawn uniformly."""
    output_tokens: int
    rate_per_s: float
    """Conversations started per second (Poisson)."""
    think_s: float
    """Mean pause between an answer and the next question (exponential)."""
    block_size: int = 16


CHAT_SHORT = ChatWorkload(
    conversations=1500,
    turns=4,
    system_tokens=256,
    question_tokens=(32, 256),
    output_tokens=128,
    rate_per_s=5.0,
    think_s=15.0,
)
"""Prompts of 0.3-1.3 k tokens, each turn extending the previous one's prompt and answer."""

WORKLOADS: dict[str, Workload | StagedWorkload | ChatWorkload] = {
    "chat-short": CHAT_SHORT,
    "llmd73": LLMD73,
    "small-groups": Workload(
        groups=400,
        prompts_per_group=4,
        system_tokens=1536,
        question_tokens=256,
        output_tokens=200,
        requests=6000,
        rate_per_s=20.0,
        skew=0.0,
    ),
    "long-cold": Workload(
        groups=20_000,
        prompts_per_group=1,
        system_tokens=0,
        question_tokens=12_000,
        output_tokens=256,
        requests=2000,
        rate_per_s=2.0,
        skew=0.0,
    ),
    "large-groups": Workload(
        groups=6,
        prompts_per_group=64,
        system_tokens=12_000,
        question_tokens=800,
        output_tokens=200,
        requests=3000,
        rate_per_s=10.0,
        skew=1.0,
    ),
}


def _prompts(w: Workload | StagedWorkload) -> list[list[list[int]]]:
    """Per group, each prompt's block ids: the group's shared blocks, then its own."""
    shared = w.system_tokens // w.block_size
    total = math.ceil((w.system_tokens + w.question_tokens) / w.block_size)
    next_id = 0
    groups: list[list[list[int]]] = []
    for _ in range(w.groups):
        prefix = list(range(next_id, next_id + shared))
        next_id += shared
        prompts = []
        for _ in range(w.prompts_per_group):
            prompts.append(prefix + list(range(next_id, next_id + total - shared)))
            next_id += total - shared
        groups.append(prompts)
    return groups


def requests(
    w: Workload | StagedWorkload | ChatWorkload, seed: int = 0
) -> Iterator[dict[str, object]]:
    """The workload's trace lines, in arrival order."""
    if isinstance(w, StagedWorkload):
        yield from _staged(w, seed)
        return
    if isinstance(w, ChatWorkload):
        yield from _chat(w, seed)
        return
    rng = Random(seed)
    groups = _prompts(w)
    weights = [1.0 / (g + 1) ** w.skew for g in range(w.groups)]
    order = list(range(w.groups))
    rng.shuffle(order)  # popularity is not the order the groups' ids were given in
    t = 0.0
    for _ in range(w.requests):
        t += rng.expovariate(w.rate_per_s)
        group = groups[order[rng.choices(range(w.groups), weights)[0]]]
        yield {
            "timestamp": round(t * 1000),
            "input_length": w.system_tokens + w.question_tokens,
            "output_length": w.output_tokens,
            "hash_ids": group[rng.randrange(len(group))],
        }


def _staged(w: StagedWorkload, seed: int) -> Iterator[dict[str, object]]:
    """Each stage draws gaps until one would pass its end; the next starts at that end."""
    rng = Random(seed)
    prompts = [prompt for group in _prompts(w) for prompt in group]
    rng.shuffle(prompts)
    t, sent = 0.0, 0
    for rate, seconds in w.stages:
        end = t + seconds
        while (gap := rng.expovariate(rate)) + t <= end:
            t += gap
            yield {
                "timestamp": round(t * 1000),
                "input_length": w.system_tokens + w.question_tokens,
                "output_length": w.output_tokens,
                "hash_ids": prompts[sent % len(prompts)],
            }
            sent += 1
        t = end


def _chat(w: ChatWorkload, seed: int) -> Iterator[dict[str, object]]:
    """Each conversation's turns, merged by time. A conversation's token stream only grows
    (question, answer, question…): a block gets its id when the stream fills it, and a
    prompt ending mid-block gets a fresh id for that partial block."""
    rng = Random(seed)
    ids = itertools.count(w.system_tokens // w.block_size)
    system = list(range(w.system_tokens // w.block_size))
    lines: list[tuple[float, dict[str, object]]] = []
    start = 0.0
    for _ in range(w.conversations):
        start += rng.expovariate(w.rate_per_s)
        t, tokens, full = start, w.system_tokens, list(system)
        for _ in range(w.turns):
            tokens += rng.randint(*w.question_tokens)
            full += [next(ids) for _ in range(tokens // w.block_size - len(full))]
            partial = [next(ids)] if tokens % w.block_size else []
            line = {
                "timestamp": round(t * 1000),
                "input_length": tokens,
                "output_length": w.output_tokens,
                "hash_ids": full + partial,
            }
            lines.append((t, line))
            tokens += w.output_tokens
            t += rng.expovariate(1 / w.think_s)
    lines.sort(key=lambda item: item[0])
    for _, line in lines:
        yield line


def write(w: Workload | StagedWorkload | ChatWorkload, out: TextIO, seed: int = 0) -> int:
    count = 0
    for line in requests(w, seed):
        out.write(json.dumps(line) + "\n")
        count += 1
    return count


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-o", "--output", required=True, help="the JSONL trace to write")
    args = parser.parse_args(argv)
    with open(args.output, "w", encoding="utf-8") as out:
        count = write(WORKLOADS[args.workload], out, args.seed)
    print(f"{args.workload}: {count} requests -> {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
