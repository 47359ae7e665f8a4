"""Faults with real processes under load: two gateways and two indexers on one Redis.

    python -m bench.replicas_faults [--prefill 4] [--decode 2] [--clients 4]
        [--lease-ttl 4] [--output bench/results/replicas-faults.json]

Starts `globalkv up --gateways 2 --indexers 2` (`LocalCluster`, with its own
`redis-server` on a free port) and drives it with `--clients` closed-loop clients, half
on each gateway, sending `/generate` prompts that share a few prefixes. Then, in order:

1. SIGSTOP one indexer for twice the lease TTL, then SIGCONT: the other takes its pods;
   the resumed one's late writes are refused (its `globalkv_ingest_fenced_writes_total`)
   and it rejoins, the pods split anew.
2. kill -9 of one indexer: seconds until the survivor owns every pod, as the clients'
   side sees it (polling `GET /v1/pods` every 50 ms) and as the survivor measured it
   (`globalkv_ingest_unfollowed_seconds`: since the dead one last renewed).
3. kill -9 of one gateway: requests failed on it (those in flight, and those its clients
   sent before they moved to the other, as a load balancer's health check would move
   them) and on the other gateway.

After each indexer fault, with the load stopped and the index given time to catch up,
"entries wrong" counts the engines' cached prefixes (`GET /_sim/cache`) whose depth in
the index differs from the engine's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.redis_process import redis_server
from globalkv.stack.cluster import LocalCluster, StackConfig

MODEL = "emulated-model"
BS = 16
FAST = ["--prefill-tokens-per-s", "200000", "--prefill-overhead-ms", "2"]
_PREFIXES = ["".join(chr(97 + (i * 7 + j) % 26) for j in range(512)) for i in range(16)]


@dataclass(slots=True)
class Load:
    """Closed-loop clients, client i on gateway i % 2 until that gateway fails it."""

    gateways: list[str]
    clients: int
    seed: int = 1
    results: list[tuple[str, float, bool]] = field(default_factory=list)
    """(gateway, time the request ended, ok)."""
    _stop: threading.Event = field(default_factory=threading.Event)
    _down: set[str] = field(default_factory=set)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        """A new phase: its own results, every gateway up again in the clients' eyes."""
        self.results.clear()
        self._down.clear()
        self._stop.clear()
        self._threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True)
            for i in range(self.clients)
        ]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def _client(self, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                gateway = self.gateways[i % len(self.gateways)]
                if gateway in self._down:  # the load balancer moved this client
                    gateway = next(g for g in self.gateways if g not in self._down)
                prompt = rng.choice(_PREFIXES) + f" question {rng.randrange(10**6)}"
                body = {"text": prompt, "sampling_params": {"max_new_tokens": 2}}
                try:
                    ok = client.post(f"{gateway}/generate", json=body).status_code == 200
                except httpx.HTTPError:
                    ok = False
                    self._down.add(gateway)
                self.results.append((gateway, time.monotonic(), ok))

    def failed(self, gateway: str, since: float) -> int:
        return sum(1 for g, at, ok in self.results if g == gateway and at >= since and not ok)

    def served(self, gateway: str, since: float) -> int:
        return sum(1 for g, at, ok in self.results if g == gateway and at >= since and ok)


def scrape(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    )


def owners(indexer_url: str) -> dict[str, str | None]:
    pods = httpx.get(f"{indexer_url}/v1/pods", timeout=5).json()["pods"]
    return {p["id"]: p["owner"] for p in pods}


def wrong_entries(cluster: LocalCluster, indexer_url: str) -> tuple[int, int]:
    """(cached prefixes whose index depth differs from the engine's, prefixes checked)."""
    wrong = checked = 0
    with httpx.Client(timeout=10) as client:
        for prefill in cluster.plan.by_role("prefill"):
            cache: dict[str, Any] = client.get(f"{prefill.url}/_sim/cache").json()
            for rank in cache["ranks"]:
                for tokens in rank["prefixes"]:
                    body = {"model": MODEL, "token_ids": tokens}
                    hits = client.post(f"{indexer_url}/v1/lookup", json=body).json()["pods"]
                    mine = [h["hit_blocks"] for h in hits if h["pod"] == prefill.pod]
                    wrong += max(mine, default=0) != len(tokens) // BS
                    checked += 1
    return wrong, checked


def settle(cluster: LocalCluster, indexer_url: str, timeout: float = 30.0) -> tuple[int, int]:
    """Entries wrong once the index had `timeout` seconds to catch up (0 as soon as it did)."""
    deadline = time.monotonic() + timeout
    while True:
        wrong, checked = wrong_entries(cluster, indexer_url)
        if wrong == 0 or time.monotonic() > deadline:
            return wrong, checked
        time.sleep(0.5)


def wait(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Seconds until `condition` held, polled every 50 ms."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - started


def _split(url: str, names: set[str]) -> Callable[[], bool]:
    return lambda: set(owners(url).values()) == names


@contextmanager
def cluster_of(args: argparse.Namespace) -> Iterator[LocalCluster]:
    with redis_server() as port:
        config = StackConfig(
            prefill=args.prefill,
            decode=args.decode,
            gateways=2,
            indexers=2,
            redis_url=f"redis://127.0.0.1:{port}/0",
            gateway_port=0,
            block_size=BS,
            prefill_args=[*FAST, "--kv-capacity", "2048"],
            decode_args=["--decode-tokens-per-s", "5000"],
            indexer_args=["--lease-ttl", str(args.lease_ttl)],
        )
        with LocalCluster(config) as cluster:
            yield cluster


def _pid(cluster: LocalCluster, name: str) -> int:
    (component,) = [c for c in cluster.components if c.name == name]
    return component.pid


def pause_indexer(cluster: LocalCluster, load: Load, ttl: float) -> dict[str, Any]:
    a, b = cluster.indexer_urls
    load.start()
    time.sleep(2)
    pid = _pid(cluster, "indexer-1")
    os.killpg(pid, signal.SIGSTOP)
    moved = wait(_split(a, {"indexer-0"}), 60, "indexer-0 to own every pod")
    time.sleep(max(0.0, 2 * ttl - moved))
    os.killpg(pid, signal.SIGCONT)
    rejoined = wait(_split(a, {"indexer-0", "indexer-1"}), 60, "the pods split anew")
    time.sleep(2)
    load.stop()
    wrong, checked = settle(cluster, a)
    return {
        "paused_s": round(max(moved, 2 * ttl), 2),
        "moved_after_s": round(moved, 2),
        "rejoined_after_s": round(rejoined, 2),
        "fenced_writes": scrape(b, "globalkv_ingest_fenced_writes_total"),
        "fenced_writes_other": scrape(a, "globalkv_ingest_fenced_writes_total"),
        "entries_wrong": wrong,
        "entries_checked": checked,
    }


def kill_indexer(cluster: LocalCluster, load: Load) -> dict[str, Any]:
    survivor = cluster.indexer_urls[1]
    load.start()
    time.sleep(2)
    count_before = scrape(survivor, "globalkv_ingest_unfollowed_seconds_count")
    sum_before = scrape(survivor, "globalkv_ingest_unfollowed_seconds_sum")
    cluster.kill("indexer-0")
    unfollowed = wait(_split(survivor, {"indexer-1"}), 60, "indexer-1 to own every pod")
    time.sleep(2)
    load.stop()
    wrong, checked = settle(cluster, survivor)
    takeovers = scrape(survivor, "globalkv_ingest_unfollowed_seconds_count") - count_before
    measured = scrape(survivor, "globalkv_ingest_unfollowed_seconds_sum") - sum_before
    return {
        "seen_unfollowed_s": round(unfollowed, 2),
        "takeovers": takeovers,
        "measured_unfollowed_mean_s": round(measured / takeovers, 2) if takeovers else None,
        "requests_failed": sum(load.failed(g, 0) for g in load.gateways),
        "entries_wrong": wrong,
        "entries_checked": checked,
    }


def kill_gateway(cluster: LocalCluster, load: Load) -> dict[str, Any]:
    kept, killed = cluster.gateway_urls
    load.start()
    time.sleep(3)
    at = time.monotonic()
    cluster.kill("gateway-1")
    time.sleep(3)
    load.stop()
    return {
        "failed_on_killed": load.failed(killed, at),
        "failed_on_other": load.failed(kept, at),
        "served_by_other_after": load.served(kept, at),
        "served_before": sum(load.served(g, 0) - load.served(g, at) for g in load.gateways),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", type=int, default=4)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--lease-ttl", type=float, default=4.0)
    parser.add_argument("--output", type=Path, default=Path("bench/results/replicas-faults.json"))
    args = parser.parse_args()
    with cluster_of(args) as cluster:
        load = Load(cluster.gateway_urls, args.clients)
        report = {
            "config": vars(args) | {"output": str(args.output)},
            "pause_indexer": pause_indexer(cluster, load, args.lease_ttl),
            "kill_indexer": kill_indexer(cluster, load),
            "kill_gateway": kill_gateway(cluster, load),
        }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
