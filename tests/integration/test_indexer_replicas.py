"""`globalkv indexer --replicas` processes sharing pods on one Redis, under faults.

kill -9 of one indexer: its pods move to the other (within the lease TTL, measured by
bench.replicas_faults, not asserted here), each followed once, and the index ends equal
to what the engines published. SIGSTOP past the lease, then SIGCONT: the paused
indexer's late writes are refused by the fence and counted, and it stops following; on
one Redis and on a Redis Cluster, where the masters' copies of the fence refuse them.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import zmq.asyncio

from globalkv import redis_client
from globalkv.registry import KvEventsConfig, PodInfo, RedisRegistry
from tests.ingest.publisher_proc import PublisherProc, chain
from tests.support.metrics import scrape
from tests.support.net import await_for, free_port
from tests.support.procs import Proc
from tests.support.redis import RedisServer

pytestmark = pytest.mark.integration

BS = 4
TTL = 1.5
PODS = ("p0", "p1", "p2", "p3")


def prompt(pod: str) -> list[int]:
    return [1000 * (PODS.index(pod) + 1) + i for i in range(64)]


def block(pod: str, n: int) -> dict[str, Any]:
    tokens = prompt(pod)[n * BS : (n + 1) * BS]
    return chain(tokens, BS, first_hash=2000 + n, parent=None if n == 0 else 1999 + n)


class Indexers:
    """Indexer processes on one Redis, by name."""

    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url
        self.procs: dict[str, Proc] = {}
        self.urls: dict[str, str] = {}

    def start(self, name: str) -> None:
        port = free_port()
        self.urls[name] = f"http://127.0.0.1:{port}"
        self.procs[name] = Proc.globalkv(
            "indexer",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--block-size",
            str(BS),
            "--redis-url",
            self.redis_url,
            "--replicas",
            "--lease-ttl",
            str(TTL),
            "--indexer-id",
            name,
            "--reconcile-interval",
            "0.5",
            name=name,
        )
        self.procs[name].wait_http(f"{self.urls[name]}/health")

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.signal(signal.SIGCONT)
            proc.stop()


@pytest.fixture
def store_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """The Redis the indexers share: one of the test's own, or with the parameter
    "cluster" the session's Redis Cluster, emptied."""
    if getattr(request, "param", "redis") == "cluster":
        yield request.getfixturevalue("redis_cluster_url")
        return
    server = RedisServer()
    yield server.url
    server.stop()


@pytest.fixture
async def publishers(
    context: zmq.asyncio.Context, store_url: str
) -> AsyncIterator[dict[str, PublisherProc]]:
    pubs: dict[str, PublisherProc] = {}
    registry = RedisRegistry(redis_client.connect(store_url))
    try:
        for pod in PODS:
            pubs[pod] = pub = await PublisherProc.start(context, name=f"pub-{pod}")
            events = KvEventsConfig(endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint)
            await registry.put(PodInfo(id=pod, model="m", kv_events=events))
        yield pubs
    finally:
        await registry.redis.aclose()
        for pub in pubs.values():
            pub.stop()


@pytest.fixture
def indexers(store_url: str) -> Iterator[Indexers]:
    group = Indexers(store_url)
    yield group
    group.stop()


async def _get(url: str, path: str) -> Any:
    async with httpx.AsyncClient(timeout=5) as client:
        response = await client.get(f"{url}{path}")
    assert response.status_code == 200, response.text
    return response.json()


async def owners(url: str) -> dict[str, str | None]:
    return {p["id"]: p["owner"] for p in (await _get(url, "/v1/pods"))["pods"]}


async def depth(url: str, pod: str) -> int:
    async with httpx.AsyncClient(timeout=5) as client:
        body = {"model": "m", "token_ids": prompt(pod)}
        response = await client.post(f"{url}/v1/lookup", json=body)
    assert response.status_code == 200, response.text
    return max((h["hit_blocks"] for h in response.json()["pods"] if h["pod"] == pod), default=0)


async def publish_until_visible(pub: PublisherProc, url: str, pod: str, first: int) -> int:
    """Publish blocks from `first` until the index shows them all; the next block's number.
    A batch sent before a new subscription is in place is lost to it (ZMQ's slow joiner)
    and comes back by replay once the next one shows the gap."""
    n = first
    async with asyncio.timeout(20):
        while True:
            await pub.publish(block(pod, n))
            n += 1
            for _ in range(25):
                if await depth(url, pod) == n:
                    return n
                await asyncio.sleep(0.02)


async def split_between(url: str, names: set[str]) -> dict[str, str | None]:
    async def split() -> bool:
        found = await owners(url)
        return set(found.values()) == names and len(found) == len(PODS)

    await await_for(split, timeout=20, what=f"the pods split over {sorted(names)}")
    return await owners(url)


async def test_kill_9_of_an_indexer_moves_its_pods_and_the_index_stays_exact(
    indexers: Indexers, publishers: dict[str, PublisherProc]
) -> None:
    indexers.start("ix-a")
    indexers.start("ix-b")
    b = indexers.urls["ix-b"]
    before = await split_between(b, {"ix-a", "ix-b"})
    assert sorted(before.values()).count("ix-a") == 2  # evenly
    published = {
        pod: await publish_until_visible(pub, b, pod, 0) for pod, pub in publishers.items()
    }

    indexers.procs["ix-a"].signal(signal.SIGKILL)
    moved = [pod for pod, owner in before.items() if owner == "ix-a"]
    for pod in moved:  # while unfollowed: in the engine's buffer only
        await publishers[pod].publish(block(pod, published[pod]), send=False)
        published[pod] += 1
    await split_between(b, {"ix-b"})
    for pod, pub in publishers.items():
        published[pod] = await publish_until_visible(pub, b, pod, published[pod])
    for pod in PODS:  # the index holds exactly what each engine published
        assert await depth(b, pod) == published[pod]
    assert scrape(b, "globalkv_ingest_lease_takeovers_total") >= len(moved)
    assert scrape(b, "globalkv_ingest_resets_total") == 0
    state = {p["id"]: p["state"] for p in (await _get(b, "/v1/pods"))["pods"]}
    assert all(state[pod]["subscribed"] for pod in PODS)


@pytest.mark.parametrize("store_url", ["redis", "cluster"], indirect=True)
async def test_an_indexer_paused_past_its_lease_is_fenced_when_it_resumes(
    indexers: Indexers, publishers: dict[str, PublisherProc]
) -> None:
    indexers.start("ix-a")
    indexers.start("ix-b")
    a, b = indexers.urls["ix-a"], indexers.urls["ix-b"]
    before = await split_between(b, {"ix-a", "ix-b"})
    published = {
        pod: await publish_until_visible(pub, b, pod, 0) for pod, pub in publishers.items()
    }

    moved = [pod for pod, owner in before.items() if owner == "ix-a"]
    for pod in moved:  # ix-a mid-write when paused: it saw a gap and awaits the replay
        await publishers[pod].call(op="hold_replay")
        await publishers[pod].publish(block(pod, published[pod]), send=False)
        await publishers[pod].publish(block(pod, published[pod] + 1))
        published[pod] += 2

        async def waiting(pod: str = pod) -> bool:
            return scrape(a, "globalkv_ingest_gaps_total", pod=pod) >= 1

        await await_for(waiting, timeout=10, what=f"ix-a to ask {pod}'s replay")
    indexers.procs["ix-a"].signal(signal.SIGSTOP)
    await split_between(b, {"ix-b"})
    for pod in moved:
        await publishers[pod].call(op="release_replay")
        published[pod] = await publish_until_visible(publishers[pod], b, pod, published[pod])
    indexers.procs["ix-a"].signal(signal.SIGCONT)  # its replay comes, or times out: it writes

    async def fenced() -> bool:
        return scrape(a, "globalkv_ingest_fenced_writes_total") >= len(moved)

    await await_for(fenced, timeout=20, what="ix-a's late writes to be refused")
    # Alive again, ix-a rejoins: the pods are split anew, and nothing it wrote late got in.
    await split_between(b, {"ix-a", "ix-b"})
    for pod, pub in publishers.items():
        published[pod] = await publish_until_visible(pub, b, pod, published[pod])
        assert await depth(b, pod) == published[pod]
    assert scrape(b, "globalkv_ingest_fenced_writes_total") == 0
