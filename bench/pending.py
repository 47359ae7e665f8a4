"""What the prefix policy's pending table adds to a routed request, on the gateway's loop.

    python -m bench.pending [--in-flight 64] [--workers 8] [--repeats 50]

Per prompt length (1k, 8k, 32k, 128k tokens; block 16), `--in-flight` prompts are already
pending on `--workers` workers, each sharing the first half of the new prompt. One routed
request then pays: keying the whole prompt (`KeyChain`, which the table needs; a lookup on
the memory index may stop earlier), `LoadTracker.pending_blocks` (the depth per worker)
and `LoadTracker.start` with the keys (the entry's set). Medians over `--repeats`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from gateway.load.tracker import LoadTracker
from gateway.policies.base import Choice
from globalkv.keys import request_chain

LENGTHS = (1024, 8192, 32768, 131072)


def measure(length: int, in_flight: int, workers: int, repeats: int) -> dict[str, float]:
    rng = random.Random(length)
    prompt = [rng.randrange(32000) for _ in range(length)]
    shared = prompt[: length // 2]
    loads = LoadTracker()
    for i in range(in_flight):
        other = shared + [rng.randrange(32000) for _ in range(length - len(shared))]
        loads.start_prefill(
            Choice(f"w{i % workers}", uncached_tokens=length), request_chain(other, 16, "m")
        )
    keying, depths, adding = [], [], []
    for _ in range(repeats):
        chain = request_chain(prompt, 16, "m")
        started = time.perf_counter()
        last_key = chain[-1]
        keyed = time.perf_counter()
        found = loads.pending_blocks(chain)
        looked = time.perf_counter()
        ticket = loads.start_prefill(Choice("new", uncached_tokens=length), chain)
        added = time.perf_counter()
        assert ticket.pending is not None
        assert last_key in ticket.pending.keys
        assert max(hit.blocks for hit in found.values()) == len(shared) // 16
        loads.finish(ticket, computed=False)
        keying.append(keyed - started)
        depths.append(looked - keyed)
        adding.append(added - looked)
    return {
        "keying": statistics.median(keying) * 1e3,
        "depths": statistics.median(depths) * 1e3,
        "add": statistics.median(adding) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    print(f"{args.in_flight} prompts pending on {args.workers} workers; p50 ms per request")
    print("| prompt tokens | keying | pending depths | add | total |")
    print("|---|---|---|---|---|")
    for length in LENGTHS:
        row = measure(length, args.in_flight, args.workers, args.repeats)
        total = sum(row.values())
        print(
            f"| {length:,} | {row['keying']:.3f} | {row['depths']:.3f} | "
            f"{row['add']:.3f} | {total:.3f} |"
        )


if __name__ == "__main__":
    main()
