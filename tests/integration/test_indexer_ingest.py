"""Ingest end to end: engines' publishers in other processes, real ZMQ, the real MemoryIndex.

Each scenario checks what a gateway would see (lookups), not only counters: a recovered
gap gives the whole chain, an unrecoverable one or an engine restart never leaves stale
blocks behind.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import msgpack
import pytest
import zmq.asyncio
from prometheus_client import CollectorRegistry

from globalkv.index.base import Source
from globalkv.index.memory import MemoryIndex
from globalkv.ingest.config import IngestConfig
from globalkv.ingest.service import IngestService
from globalkv.lookup import IndexLookup
from globalkv.metrics import IngestMetrics
from globalkv.registry import KvEventsConfig, MemoryRegistry, PodInfo
from globalkv.wire import live_frames
from tests.ingest.publisher_proc import PublisherProc, chain
from tests.support.metrics import sample
from tests.support.net import await_for

pytestmark = pytest.mark.integration

BS = 4
PROMPT = list(range(100, 164))  # 16 blocks


@pytest.fixture
def prom() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def index() -> MemoryIndex:
    return MemoryIndex(BS)


@pytest.fixture
async def service(
    context: zmq.asyncio.Context, index: MemoryIndex, prom: CollectorRegistry
) -> AsyncIterator[IngestService]:
    config = IngestConfig(bind=["tcp://127.0.0.1:0"], replay_reply_timeout=0.5)
    service = IngestService(index, MemoryRegistry(), IngestMetrics(prom), config, context=context)
    await service.start()
    yield service
    await service.stop()


@pytest.fixture
async def publishers(
    context: zmq.asyncio.Context,
) -> AsyncIterator[Callable[..., Awaitable[PublisherProc]]]:
    started: list[PublisherProc] = []

    async def start(**kw: object) -> PublisherProc:
        publisher = await PublisherProc.start(context, **kw)
        started.append(publisher)
        return publisher

    yield start
    for publisher in started:
        publisher.stop()


async def follow(service: IngestService, pub: PublisherProc, pod_id: str) -> None:
    """Follow the pod; return once subscribed and the catch-up a new source starts with is
    answered, so that the batches published next arrive live, not by that replay."""
    served = (await pub.call(op="replays_served"))["served"]
    await service.following.add(
        PodInfo(
            id=pod_id,
            model="m",
            kv_events=KvEventsConfig(endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint),
        )
    )
    await pub.call(op="wait_subscribed")
    if pub.replay_endpoint is None:
        return

    async def answered() -> bool:
        return bool((await pub.call(op="replays_served"))["served"] > served)

    await await_for(answered, timeout=10.0, what="the catch-up's replay")


async def hits(index: MemoryIndex, tokens: list[int] = PROMPT) -> dict[str, int]:
    result = await IndexLookup(index).lookup("m", tokens)
    return {p.pod: p.hit_blocks for p in result.pods}


REASONS = (
    "bad_frames",
    "bad_seq",
    "not_msgpack",
    "bad_batch",
    "bad_event",
    "bad_hash",
    "bad_field",
    "bad_tokens",
)


def block(n: int) -> dict[str, object]:
    """Block n of PROMPT, chained to block n - 1 (engine hashes 1000 + n)."""
    return chain(
        PROMPT[n * BS : (n + 1) * BS], BS, first_hash=1000 + n, parent=None if n == 0 else 999 + n
    )


@pytest.mark.parametrize(("flavor", "layout"), [("vllm", "topic"), ("sglang", "seq")])
async def test_live_stream_and_a_gap_recovered_by_replay(
    service: IngestService,
    index: MemoryIndex,
    prom: CollectorRegistry,
    publishers: Callable[..., Awaitable[PublisherProc]],
    flavor: str,
    layout: str,
) -> None:
    pub = await publishers(flavor=flavor, layout=layout)
    await follow(service, pub, "p0")
    await pub.publish(block(0))
    await pub.publish(block(1))
    await service.followed.applied(Source("p0"), 1)
    assert await hits(index) == {"p0": 2}
    await pub.publish(block(2), send=False)
    await pub.publish(block(3), send=False)
    seq = await pub.publish(block(4))
    await service.followed.applied(Source("p0"), seq)
    assert await hits(index) == {"p0": 5}
    assert sample(prom, "globalkv_ingest_replays_total", pod="p0", outcome="complete") == 1


async def test_gap_past_the_replay_buffer_resets_the_pod(
    service: IngestService,
    index: MemoryIndex,
    prom: CollectorRegistry,
    publishers: Callable[..., Awaitable[PublisherProc]],
) -> None:
    pub = await publishers(buffer_steps=2)
    await follow(service, pub, "p0")
    await pub.publish(block(0))
    await service.followed.applied(Source("p0"), 0)
    for n in range(1, 5):
        await pub.publish(block(n), send=False)
    await pub.publish({"type": "BlockRemoved", "block_hashes": [1000]}, send=False)
    other = list(range(500, 508))
    seq = await pub.publish(chain(other, BS, first_hash=1))
    await service.followed.applied(Source("p0"), seq)
    assert await hits(index) == {}, "block 0 was removed while we missed it: it must be gone"
    assert await hits(index, other) == {"p0": 2}
    assert sample(prom, "globalkv_ingest_resets_total", pod="p0", reason="gap") == 1


async def test_engine_restart_drops_what_the_old_engine_held(
    service: IngestService,
    index: MemoryIndex,
    prom: CollectorRegistry,
    publishers: Callable[..., Awaitable[PublisherProc]],
) -> None:
    pub = await publishers()
    await follow(service, pub, "p0")
    for n in range(3):
        seq = await pub.publish(block(n))
    await service.followed.applied(Source("p0"), seq)
    assert await hits(index) == {"p0": 3}
    await pub.call(op="restart")
    await pub.publish(chain(PROMPT[:BS], BS, first_hash=77))
    await service.followed.wait(
        Source("p0"), lambda state: state.resets == 1 and state.last_seq == 0
    )
    assert await hits(index) == {"p0": 1}
    assert sample(prom, "globalkv_ingest_resets_total", pod="p0", reason="restart") == 1


async def test_bind_mode_names_pods_by_topic(
    service: IngestService,
    index: MemoryIndex,
    publishers: Callable[..., Awaitable[PublisherProc]],
) -> None:
    (bound,) = service.bound.endpoints
    a = await publishers(connect_to=bound, topic="kv@a@m", replay=False, name="pub-a")
    b = await publishers(connect_to=bound, topic="kv@b@m", replay=False, dp_rank=3, name="pub-b")
    await a.call(op="wait_subscribed")
    await b.call(op="wait_subscribed")
    await a.publish(block(0), block(1))
    seq = await b.publish(block(0))
    await service.followed.applied(Source("a"), 0)
    await service.followed.applied(Source("b", 3), seq)
    result = await IndexLookup(index).lookup("m", PROMPT)
    assert {(p.pod, p.dp_rank, p.hit_blocks) for p in result.pods} == {("a", 0, 2), ("b", 3, 1)}
    assert {p.id for p in service.following.pods()} == {"a", "b"}


async def test_garbage_of_every_kind_is_counted_while_good_pods_flow(
    service: IngestService,
    index: MemoryIndex,
    prom: CollectorRegistry,
    publishers: Callable[..., Awaitable[PublisherProc]],
) -> None:
    good, bad = await publishers(name="good"), await publishers(name="bad")
    await follow(service, good, "good")
    await follow(service, bad, "bad")
    (bound,) = service.bound.endpoints
    stray = await publishers(connect_to=bound, topic="whatever", replay=False, name="stray")
    await stray.call(op="wait_subscribed")
    garbage: list[tuple[bytes, ...]] = [
        (b"one frame",),
        (b"", b"seq too short", b"x"),
        tuple(live_frames(b"", 0, b"\xc1")),
        tuple(live_frames(b"", 1, msgpack.packb(["x", [], None]))),
        tuple(live_frames(b"", 2, msgpack.packb([0.0, [5]]))),
        tuple(live_frames(b"", 3, msgpack.packb([0.0, [["BlockRemoved", ["x"]]]]))),
        tuple(live_frames(b"", 4, msgpack.packb([0.0, [["BlockStored", [1], None, [1], 0]]]))),
        tuple(live_frames(b"", 5, msgpack.packb([0.0, [["BlockStored", [1], None, [-1], 1]]]))),
    ]
    for n in range(len(garbage)):
        await good.publish(block(n))
        await bad.raw(*garbage[n])
        await stray.publish(block(n))
    seq = await good.publish(block(len(garbage)))
    await service.followed.applied(Source("good"), seq)
    await bad.raw(*live_frames(b"", 6, msgpack.packb([0.0, []])))
    await service.followed.wait(Source("bad"), lambda state: state.last_seq == 6)
    assert await hits(index) == {"good": len(garbage) + 1}
    dropped = {
        reason: sample(prom, "globalkv_ingest_dropped_total", reason=reason) for reason in REASONS
    }
    assert dropped == dict.fromkeys(REASONS, 1)
    assert sample(prom, "globalkv_ingest_gaps_total", pod="bad") == 0
    assert sample(prom, "globalkv_ingest_dropped_total", reason="unknown_topic") == len(garbage)
