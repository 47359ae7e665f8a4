"""Two indexers sharing pods by leases, in one process on one real Redis.

A dead indexer (its loop stopped, its lease left to expire) loses its pods to the other,
which continues each from the last applied seq by replay; a paused one that comes back
writing is fenced: its late writes are refused and counted, and it stops following.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import zmq.asyncio

from globalkv import redis_client
from globalkv.index.base import Source
from globalkv.index.redis import RedisIndex
from globalkv.indexer import Indexer, IndexerConfig
from globalkv.ingest.config import IngestConfig
from globalkv.ingest.leases import Leases
from globalkv.keys import request_keys
from globalkv.registry import KvEventsConfig, PodInfo, RedisRegistry
from kvplumbing.tasks import cancel_and_wait
from tests.ingest.publisher import Publisher, event_from_json
from tests.ingest.publisher_proc import chain
from tests.support.metrics import sample
from tests.support.net import await_for

BS = 4
TTL = 0.6
PODS = ("p0", "p1", "p2", "p3")


def prompt(pod: str) -> list[int]:
    return [1000 * (PODS.index(pod) + 1) + i for i in range(40)]


def block(pod: str, n: int) -> list[object]:
    tokens = prompt(pod)[n * BS : (n + 1) * BS]
    parent = None if n == 0 else 1999 + n
    return [event_from_json(chain(tokens, BS, first_hash=2000 + n, parent=parent))]


async def _indexer(url: str, name: str) -> Indexer:
    redis = redis_client.connect(url)
    config = IndexerConfig(
        block_size=BS,
        redis_url=url,
        replicas=True,
        lease_ttl=TTL,
        indexer_id=name,
        reconcile_interval=0.2,
        ingest=IngestConfig(retry_base=0.02, retry_cap=0.2, replay_reply_timeout=2.0),
    )
    indexer = Indexer(
        config,
        index=RedisIndex(redis, BS, fenced=True),
        registry=RedisRegistry(redis),
        redis=redis,
        leases=Leases(redis),
    )
    await indexer.start()
    return indexer


@pytest.fixture
async def publishers(context: zmq.asyncio.Context) -> AsyncIterator[dict[str, Publisher]]:
    pubs = {
        pod: Publisher(context, endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
        for pod in PODS
    }
    for pub in pubs.values():
        await pub.start()
    yield pubs
    for pub in pubs.values():
        await pub.stop()


async def _register(url: str, pubs: dict[str, Publisher]) -> None:
    registry = RedisRegistry(redis_client.connect(url))
    for pod, pub in pubs.items():
        events = KvEventsConfig(endpoint=pub.endpoint, replay_endpoint=pub.bound_replay_endpoint)
        await registry.put(PodInfo(id=pod, model="m", kv_events=events))
    await registry.redis.aclose()


async def publish_until_applied(
    pub: Publisher, indexer: Indexer, pod: str, first: int, timeout: float = 15.0
) -> int:
    """Publish blocks first, first + 1, … until one is applied; the next block's number.

    A subscription that just connected misses what is sent before it is in place (ZMQ's
    slow joiner); what it missed is then a gap, repaired by replay from the buffer."""
    n = first
    async with asyncio.timeout(timeout):
        while True:
            seq = await pub.send(block(pod, n))
            n += 1
            try:
                await indexer.ingest.followed.applied(Source(pod), seq, timeout=0.5)
                return n
            except TimeoutError:
                continue


def _followed(*indexers: Indexer) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for indexer in indexers:
        for info in indexer.ingest.following.pods():
            out.setdefault(info.id, []).append(indexer.config.member_id)
    return out


def _condition(check: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def condition() -> bool:
        return check()

    return condition


async def _depth(indexer: Indexer, pod: str) -> int:
    hits = await indexer.index.lookup(request_keys(prompt(pod), BS, "m"))
    return max((h.blocks for h in hits if h.source.pod == pod), default=0)


async def _die(indexer: Indexer) -> None:
    """As kill -9 would leave it: no release, no leave; the leases run out by their TTL."""
    assert indexer._ownership_task is not None
    await cancel_and_wait([indexer._ownership_task, indexer._podsync_task])
    await indexer.ingest.stop()


@pytest.mark.parametrize("redis", ["redis_url", "redis_cluster_url"])
async def test_pods_are_split_and_move_to_the_survivor_continuing_by_replay(
    redis: str, publishers: dict[str, Publisher], request: pytest.FixtureRequest
) -> None:
    redis_url = request.getfixturevalue(redis)
    await _register(redis_url, publishers)
    a = await _indexer(redis_url, "ix-a")
    b = await _indexer(redis_url, "ix-b")
    try:

        def split_evenly() -> bool:
            followed = _followed(a, b)
            return (
                set(followed) == set(PODS)
                and all(len(f) == 1 for f in followed.values())
                and len(a.ingest.following.pods()) == len(b.ingest.following.pods()) == 2
            )

        await await_for(_condition(split_evenly), timeout=15, what="the pods split 2 + 2")
        published: dict[str, int] = {}
        for pod, pub in publishers.items():
            owner = a if pod in {p.id for p in a.ingest.following.pods()} else b
            published[pod] = await publish_until_applied(pub, owner, pod, 0)
        a_pods = sorted(p.id for p in a.ingest.following.pods())

        await _die(a)
        for pod in a_pods:  # while nobody follows them: only in the engines' buffers
            await publishers[pod].send(block(pod, published[pod]), live=False)

        def b_follows_all() -> bool:
            return sorted(_followed(b)) == sorted(PODS)

        await await_for(_condition(b_follows_all), timeout=15, what="b to take a's pods")
        for pod in a_pods:
            blocks = await publish_until_applied(publishers[pod], b, pod, published[pod] + 1)
            assert await _depth(b, pod) == blocks  # the unsent block came by replay
        prom = b.metrics_registry
        # Two handed over when b joined (a released them), two taken after a died.
        assert sample(prom, "globalkv_ingest_lease_takeovers_total") == 4
        assert sample(prom, "globalkv_ingest_unfollowed_seconds_count") == 4
        for pod in a_pods:
            assert sample(prom, "globalkv_ingest_resets_total", pod=pod, reason="gap") == 0
    finally:
        await b.stop()
        await a.stop()


@pytest.mark.parametrize("redis", ["redis_url", "redis_cluster_url"])
async def test_a_paused_indexer_is_fenced_its_late_writes_refused_and_counted(
    redis: str, request: pytest.FixtureRequest, publishers: dict[str, Publisher]
) -> None:
    redis_url = request.getfixturevalue(redis)
    pubs = {"p0": publishers["p0"]}
    await _register(redis_url, pubs)
    a = await _indexer(redis_url, "ix-a")
    try:
        await await_for(_condition(lambda: _followed(a) == {"p0": ["ix-a"]}), 10, "a follows p0")
        first = await publish_until_applied(pubs["p0"], a, "p0", 0)

        assert a._ownership_task is not None
        await cancel_and_wait([a._ownership_task])  # paused: no renewals, ingest still running
        b = await _indexer(redis_url, "ix-b")
        try:
            await await_for(_condition(lambda: "p0" in _followed(b)), 15, "b to take p0")
            blocks = await publish_until_applied(pubs["p0"], b, "p0", first)  # a gets them too

            def a_gave_up() -> bool:
                return "p0" not in _followed(a)

            await await_for(_condition(a_gave_up), 10, "a to stop following p0")
            assert sample(a.metrics_registry, "globalkv_ingest_fenced_writes_total", pod="p0") >= 1
            assert sample(b.metrics_registry, "globalkv_ingest_fenced_writes_total", pod="p0") == 0
            (stats,) = await b.index.stats("p0")
            assert stats.last_seq == blocks - 1
            assert await _depth(b, "p0") == blocks
        finally:
            await b.stop()
    finally:
        await a.stop()


async def test_a_second_live_process_under_one_id_is_yielded_to_not_fought(
    redis_url: str, publishers: dict[str, Publisher]
) -> None:
    """A restart under an id takes its predecessor's leases at once; when both live, the
    earlier one says it is displaced and stops taking them back (else each step of either
    took the pods from the other, fencing its writes)."""
    pubs = {pod: publishers[pod] for pod in PODS[:2]}
    await _register(redis_url, pubs)
    a = await _indexer(redis_url, "same")
    try:
        assert sorted(p.id for p in a.ingest.following.pods()) == sorted(pubs)
        b = await _indexer(redis_url, "same")  # its first step took both pods
        try:
            assert sorted(p.id for p in b.ingest.following.pods()) == sorted(pubs)
            await await_for(_condition(lambda: a.ownership.displaced), 10, "a to see b")
            for indexer in (a, b, a, b):  # and the steps of their own loops meanwhile
                assert indexer.ownership is not None
                await indexer.ownership.step()
            assert not a.ingest.following.pods()
            assert sorted(p.id for p in b.ingest.following.pods()) == sorted(pubs)
            assert sample(a.metrics_registry, "globalkv_ingest_displaced") == 1
            assert sample(b.metrics_registry, "globalkv_ingest_displaced") == 0
        finally:
            await b.stop()
    finally:
        await a.stop()
