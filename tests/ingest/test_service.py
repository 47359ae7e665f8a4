"""Ingest over real ZMQ sockets in this process: ordering, gaps, replay, resets, resync."""

from __future__ import annotations

import asyncio
import socket

import msgpack
import pytest
import zmq.asyncio
from prometheus_client import CollectorRegistry

from globalkv.index.base import Source, StoreBlocks
from globalkv.ingest import border
from globalkv.ingest.border import Received
from globalkv.ingest.replay import ReplayClient
from globalkv.ingest.worker import SourceWorker
from globalkv.keys import EngineHash, root_key
from globalkv.metrics import IngestMetrics
from globalkv.registry import KvEventsConfig, MemoryRegistry, PodInfo
from globalkv.wire import BlockStored, Event, EventBatch, encode_batch, live_frames
from tests.ingest.conftest import PublisherFactory, ServiceFactory
from tests.ingest.fakes import RecordingIndex
from tests.ingest.publisher import Publisher
from tests.support.metrics import sample
from tests.support.net import await_for, free_port

P0 = Source("p0", 0)


def store(n: int) -> BlockStored:
    return BlockStored(
        block_hashes=[EngineHash(n + 1)],
        parent_block_hash=None if n == 0 else EngineHash(n),
        token_ids=[n, n, n, n],
        block_size=4,
        medium="GPU",
    )


def pod_for(pub: Publisher, pod_id: str = "p0") -> PodInfo:
    events = KvEventsConfig(endpoint=pub.endpoint, replay_endpoint=pub.bound_replay_endpoint)
    return PodInfo(id=pod_id, model="m", kv_events=events)


def of_rank(pub: Publisher, dp_rank: int, events: list[Event], seq: int = 0) -> list[bytes]:
    """A batch of another DP rank on this publisher's connection: the order is kept."""
    batch = EventBatch(ts=1.0, events=events, dp_rank=dp_rank)
    return live_frames(pub.settings.topic, seq, encode_batch(batch, pub.settings.flavor))


async def follow(service: object, pub: Publisher, pod: PodInfo, *, caught_up: bool = True) -> None:
    """Follow `pod` and return once it is subscribed and (`caught_up`, when it has this
    publisher's replay endpoint) the catch-up a new source starts with is answered. Without
    that wait a batch sent next may arrive by the catch-up's replay or live, depending on
    which is first, and the replays counted differ."""
    served = pub.replays_served()
    await service.following.add(pod)  # type: ignore[attr-defined]
    await pub.wait_subscribed()
    replay = pod.kv_events.replay_endpoint if pod.kv_events is not None else None
    if caught_up and replay is not None and replay == pub.bound_replay_endpoint:

        async def answered() -> bool:
            return pub.replays_served() > served

        await await_for(answered, timeout=10.0, what="the catch-up's replay")


async def test_live_stream_is_applied_in_order(
    make_service: ServiceFactory,
    make_publisher: PublisherFactory,
    index: RecordingIndex,
    prom: CollectorRegistry,
) -> None:
    service, pub = make_service(), await make_publisher(flavor="sglang")
    await follow(service, pub, pod_for(pub))
    for n in range(5):
        await pub.send([store(n)])
    await service.followed.applied(P0, 4)
    assert index.applied[P0] == [0, 1, 2, 3, 4]
    first = index.batches[0].events[0]
    assert isinstance(first, StoreBlocks)
    assert first.namespace == root_key("m")
    assert sample(prom, "globalkv_ingest_blocks_stored_total", pod="p0") == 5
    state = service.states()["p0"]
    assert state.subscribed
    assert state.sources[0].last_seq == 4
    assert state.sources[0].last_event_ts == 5.0


@pytest.mark.parametrize("layout", ["seq", "topic"])
async def test_gap_is_filled_by_replay_in_either_layout(
    make_service: ServiceFactory,
    make_publisher: PublisherFactory,
    index: RecordingIndex,
    prom: CollectorRegistry,
    layout: str,
) -> None:
    service, pub = make_service(), await make_publisher(layout=layout, topic="kv@p0@m")
    await follow(service, pub, pod_for(pub))
    await pub.send([store(0)])
    await pub.send([store(1)], live=False)
    await pub.send([store(2)], live=False)
    await pub.send([store(3)])
    await service.followed.applied(P0, 3)
    assert index.applied[P0] == [0, 1, 2, 3]
    assert sample(prom, "globalkv_ingest_gaps_total", pod="p0") == 1
    assert sample(prom, "globalkv_ingest_replays_total", pod="p0", outcome="complete") == 1
    assert sample(prom, "globalkv_ingest_replayed_batches_total", pod="p0") == 2


async def test_gap_past_the_replay_buffer_resets_and_keeps_the_contiguous_tail(
    make_service: ServiceFactory,
    make_publisher: PublisherFactory,
    index: RecordingIndex,
    prom: CollectorRegistry,
) -> None:
    service, pub = make_service(), await make_publisher()
    await follow(service, pub, pod_for(pub))
    await pub.send([store(0)])
    for n in range(1, 6):
        await pub.send([store(n)], live=False)
    pub.forget(keep=2)
    await pub.send([store(6)])
    await service.followed.applied(P0, 6)
    assert index.applied[P0] == [0, -1, 4, 5, 6]
    assert sample(prom, "globalkv_ingest_resets_total", pod="p0", reason="gap") == 1
    assert sample(prom, "globalkv_ingest_replays_total", pod="p0", outcome="short") == 1


async def test_a_replay_past_its_byte_budget_stops_and_resets(
    make_service: ServiceFactory,
    make_publisher: PublisherFactory,
    index: RecordingIndex,
    prom: CollectorRegistry,
) -> None:
    """Each buffered batch is ~40 KiB; the replay may hold 64 KiB: it stops at the second."""
    service, pub = make_service(replay_max_bytes=64 << 10), await make_publisher()
    await follow(service, pub, pod_for(pub))
    await pub.send([store(0)])
    for n in range(1, 6):
        await pub.send([store(k) for k in range(n, n + 1000)], live=False)
    assert all(len(batch.payload) > 32 << 10 for batch in list(pub.buffer)[1:])
    await pub.send([store(6)])
    await service.followed.applied(P0, 6)
    assert index.applied[P0] == [0, -1, 6]
    assert sample(prom, "globalkv_ingest_replays_total", pod="p0", outcome="limit") == 1
    assert sample(prom, "globalkv_ingest_resets_total", pod="p0", reason="gap") == 1


@pytest.mark.parametrize(
    ("replay_endpoint", "outcome"),
    [
        (None, "no_endpoint"),
        ("tcp://127.0.0.1:9", "timeout"),
        ("ipc:///tmp/" + "x" * 200, "no_endpoint"),  # valid to the registry; ZMQ refuses it
    ],
)
async def test_a_gap_replay_cannot_fill_resets(
    make_service: ServiceFactory,
    make_publisher: PublisherFactory,
    index: RecordingIndex,
    prom: CollectorRegistry,
    replay_endpoint: str | None,
    outcome: str,
) -> None:
    """No replay endpoint, one nobody answers on (ZMQ cannot tell it from slow), or one
    ZMQ refuses to connect to. The catch-up on following fails alike (none is tried
    without an endpoint)."""
    service = make_service(allow_endpoint_schemes=["ipc"])
    pub = await make_publisher(replay_endpoint=None)
    events = KvEventsConfig(endpoint=pub.endpoint, replay_endpoint=replay_endpoint)
    await follow(service, pub, PodInfo(id="p0", model="m", kv_events=events))
    await service.followed.flush()
    caught_up = sample(prom, "globalkv_ingest_replays_total", pod="p0", outcome=outcome) or 0
    assert caught_up == (0 if replay_endpoint is None else 1)
    await pub.send([store(0)])
    await pub.send([store(1)], live=False)
    await pub.send([store(2)])
    await service.followed.applied(P0, 2)
    assert index.applied[P0] == [0, -1, 2]
    replays = sample(prom, "globalkv_ingest_replays_total", pod="p0", outcome=outcome)
    assert replays == caught_up + 1


async def test_engine_restart_resets_and_replays_the_new_first_batches(
    make_service: ServiceFactory,
    make_publisher: PublisherFactory,
    index: RecordingIndex,
    prom: CollectorRegistry,
) -> None:
    service, pub = make_service(), await make_publisher()
    await follow(service, pub, pod_for(pub))
    for n in range(3):
        await pub.send([store(n)])
    await service.followed.applied(P0, 2)
    pub.restart()
    await pub.send([store(0)], live=False)
    await pub.send([store(1)])
    await pub.send([store(2)])
    await service.followed.wait(P0, lambda state: state.applied == 6)
    assert index.applied[P0] == [0, 1, 2, -1, 0, 1, 2]
    assert sample(prom, "globalkv_ingest_resets_total", pod="p0", reason="restart") == 1


async def test_late_join_replays_history_without_reset(
    make_service: ServiceFactory,
    make_publisher: PublisherFactory,
    index: RecordingIndex,
) -> None:
    service, pub = make_service(), await make_publisher()
    await pub.send([store(0)])
    await pub.send([store(1)])
    await follow(service, pub, pod_for(pub))
    await pub.send([store(2)])
    await service.followed.applied(P0, 2)
    assert index.applied[P0] == [0, 1, 2]


async def test_late_join_with_a_replay_endpoint_zmq_refuses_goes_on_live(
    make_service: ServiceFactory,
    make_publisher: PublisherFactory,
    index: RecordingIndex,
    prom: CollectorRegistry,
) -> None:
    service = make_service(allow_endpoint_schemes=["ipc"])
    pub = await make_publisher(replay_endpoint=None)
    pub.next_seq = 5  # the engine published before we followed it
    refused = "ipc:///tmp/" + "x" * 200  # too long a path for a unix socket
    events = KvEventsConfig(endpoint=pub.endpoint, replay_endpoint=refused)
    await follow(service, pub, PodInfo(id="p0", model="m", kv_events=events))
    await pub.send([store(5)])
    await pub.send([store(6)])
    await service.followed.applied(P0, 6)
    assert index.applied[P0] == [5, 6]
    refused = sample(prom, "globalkv_ingest_replays_total", pod="p0", outcome="no_endpoint")
    assert refused == 2, "the catch-up on following and the join"
    assert sample(prom, "globalkv_ingest_dropped_total", reason="internal_error") in (None, 0)


async def test_resume_point_comes_from_the_index(
    make_service: ServiceFactory,
    make_publisher: PublisherFactory,
    index: RecordingIndex,
) -> None:
    index.applied[P0] = [0, 1]
    service, pub = make_service(), await make_publisher()
    pub.next_seq = 2
    await follow(service, pub, pod_for(pub))
    await pub.send([store(2)])
    await service.followed.applied(P0, 2)
    assert index.applied[P0] == [0, 1, 2]


async def test_garbage_frames_are_counted_and_dropped(
    make_service: ServiceFactory,
    make_publisher: PublisherFactory,
    index: RecordingIndex,
    prom: CollectorRegistry,
) -> None:
    service, pub = make_service(), await make_publisher()
    await follow(service, pub, pod_for(pub))
    await pub.send([store(0)])
    await pub.raw([b"", b"short", b"x"])
    await pub.raw([b"one frame"])
    await pub.raw(live_frames(b"", 1, b"\xc1 not msgpack"))
    pub.next_seq = 2
    await pub.send([store(2)])
    await service.followed.applied(P0, 2)
    assert index.applied[P0] == [0, 2]
    assert sample(prom, "globalkv_ingest_dropped_total", reason="bad_seq") == 1
    assert sample(prom, "globalkv_ingest_dropped_total", reason="bad_frames") == 1
    assert sample(prom, "globalkv_ingest_dropped_total", reason="not_msgpack") == 1
    assert sample(prom, "globalkv_ingest_gaps_total", pod="p0") == 0
    assert service.states()["p0"].sources[0].applied == 2, "the malformed batch is not applied"
    assert sample(prom, "globalkv_ingest_batches_applied_total", pod="p0") == 2


async def test_index_unavailable_holds_and_retries(
    make_service: ServiceFactory,
    make_publisher: PublisherFactory,
    index: RecordingIndex,
    prom: CollectorRegistry,
) -> None:
    service, pub = make_service(), await make_publisher()
    await follow(service, pub, pod_for(pub))
    index.unavailable = 3
    await pub.send([store(0)])
    await pub.send([store(1)])
    await service.followed.applied(P0, 1)
    assert index.applied[P0] == [0, 1]
    assert sample(prom, "globalkv_ingest_index_unavailable_total") == 3


async def test_data_lost_resyncs_every_source(
    make_service: ServiceFactory,
    make_publisher: PublisherFactory,
    index: RecordingIndex,
    registry: MemoryRegistry,
    prom: CollectorRegistry,
) -> None:
    service = make_service()
    busy, idle = await make_publisher(), await make_publisher(buffer_steps=1)
    await follow(service, busy, pod_for(busy, "busy"))
    await follow(service, idle, pod_for(idle, "idle"))
    for n in range(3):
        await busy.send([store(n)])
        await idle.send([store(n)])
    await service.followed.applied(Source("busy"), 2)
    await service.followed.applied(Source("idle"), 2)
    index.lose_data = True
    await busy.send([store(3)])
    await service.followed.applied(Source("busy"), 3)
    await service.followed.flush()
    assert service.recovery.ready
    assert index.applied[Source("busy")] == [0, 1, 2, 3]
    assert index.applied[Source("idle")] == [-1, 2]
    assert sample(prom, "globalkv_ingest_index_data_lost_total") == 1
    assert sample(prom, "globalkv_ingest_resets_total", pod="idle", reason="data_lost") == 1
    assert sample(prom, "globalkv_ingest_resyncing_sources") == 0


async def test_data_lost_of_some_sources_resyncs_only_those(
    make_service: ServiceFactory,
    make_publisher: PublisherFactory,
    index: RecordingIndex,
    registry: MemoryRegistry,
    prom: CollectorRegistry,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cluster master failed over without some block writes: the sources written there
    are rebuilt, the others (the one that noticed, too) go on as they were."""
    service = make_service()
    pubs = {name: await make_publisher(buffer_steps=1) for name in ("busy", "lost", "calm")}
    for name, pub in pubs.items():
        await follow(service, pub, pod_for(pub, name))
    for n in range(3):
        for name, pub in pubs.items():
            await pub.send([store(n)])
            await service.followed.applied(Source(name), n)
    restored: list[object] = []
    monkeypatch.setattr(registry, "mark", lambda: restored.append(None) or asyncio.sleep(0))
    index.lose_data, index.lose_only = True, frozenset({Source("lost")})
    await pubs["busy"].send([store(3)])
    await service.followed.applied(Source("busy"), 3)
    await service.followed.flush()
    assert service.recovery.ready
    assert index.applied[Source("busy")] == [0, 1, 2, 3], "applied again, not rebuilt"
    assert index.applied[Source("lost")] == [-1, 2]
    assert index.applied[Source("calm")] == [0, 1, 2]
    assert sample(prom, "globalkv_ingest_index_data_lost_total") == 1
    assert sample(prom, "globalkv_ingest_resets_total", pod="lost", reason="data_lost") == 1
    assert sample(prom, "globalkv_ingest_resyncing_sources") == 0
    assert not restored, "the registry lost nothing: it is not written back"


async def test_bound_socket_names_pods_by_topic_and_dp_rank(
    make_service: ServiceFactory,
    make_publisher: PublisherFactory,
    index: RecordingIndex,
    registry: MemoryRegistry,
    prom: CollectorRegistry,
) -> None:
    service = make_service(bind=["tcp://127.0.0.1:0"])
    await service.start()
    (bound,) = service.bound.endpoints
    pub = await make_publisher(
        endpoint=bound, connect=True, replay_endpoint=None, topic="kv@p9@org/model"
    )
    stray = await make_publisher(
        endpoint=bound, connect=True, replay_endpoint=None, topic="not-a-kv-topic"
    )
    await pub.wait_subscribed()
    await stray.wait_subscribed()
    await stray.send([store(0)])
    await pub.send([store(0)])
    await pub.raw(of_rank(pub, 1, [store(0)]))
    await service.followed.applied(Source("p9", 0), 0)
    await service.followed.applied(Source("p9", 1), 0)
    assert index.applied == {Source("p9", 0): [0], Source("p9", 1): [0]}
    first = index.batches[0].events[0]
    assert isinstance(first, StoreBlocks)
    assert first.namespace == root_key("org/model")
    assert sample(prom, "globalkv_ingest_dropped_total", reason="unknown_topic") == 1
    await asyncio.wait_for(_registered(registry, "p9"), 5)


async def _registered(registry: MemoryRegistry, pod_id: str) -> None:
    changes = registry.changes()
    if await registry.get(pod_id) is None:
        async for changed in changes:
            if changed == pod_id:
                break
    await changes.aclose()


async def test_a_bound_message_that_is_no_batch_discovers_no_pod(
    make_service: ServiceFactory,
    make_publisher: PublisherFactory,
    index: RecordingIndex,
    registry: MemoryRegistry,
    prom: CollectorRegistry,
) -> None:
    service = make_service(bind=["tcp://127.0.0.1:0"])
    await service.start()
    pub = await make_publisher(
        endpoint=service.bound.endpoints[0], connect=True, replay_endpoint=None, topic="kv@ok@m"
    )
    await pub.wait_subscribed()
    await pub.raw(live_frames(b"kv@intruder@m", 0, b"\xc1 not msgpack"))
    await pub.send([store(0)])  # after the garbage, on the same connection
    await service.followed.applied(Source("ok"), 0)
    await asyncio.wait_for(_registered(registry, "ok"), 5)
    assert [pod.id for pod in service.following.pods()] == ["ok"]
    assert await registry.get("intruder") is None
    assert sample(prom, "globalkv_ingest_dropped_total", reason="not_msgpack") == 1


async def test_pods_discovered_on_the_bound_socket_are_bounded(
    make_service: ServiceFactory,
    make_publisher: PublisherFactory,
    index: RecordingIndex,
    registry: MemoryRegistry,
    prom: CollectorRegistry,
) -> None:
    service = make_service(bind=["tcp://127.0.0.1:0"], max_discovered_pods=2)
    await service.start()
    pub = await make_publisher(
        endpoint=service.bound.endpoints[0], connect=True, replay_endpoint=None, topic="kv@a@m"
    )
    await pub.wait_subscribed()
    await pub.send([store(0)])
    batch = pub.buffer[-1].payload
    for name in ("b", "c", "d"):
        await pub.raw(live_frames(f"kv@{name}@m".encode(), 0, batch))
    await pub.send([store(1)])
    await service.followed.applied(Source("a"), 1)
    assert sorted(pod.id for pod in service.following.pods()) == ["a", "b"]
    assert sample(prom, "globalkv_ingest_dropped_total", reason="pod_limit") == 2
    await service.following.remove("b")  # frees its place
    await pub.raw(live_frames(b"kv@c@m", 0, batch))
    await service.followed.applied(Source("c"), 0)
    assert sorted(pod.id for pod in service.following.pods()) == ["a", "c"]


async def test_names_flooding_the_bound_socket_cost_nothing_once_gone(
    make_service: ServiceFactory,
    make_publisher: PublisherFactory,
    registry: MemoryRegistry,
    prom: CollectorRegistry,
) -> None:
    """40,960 tiny messages, each naming a new pod (the flood that once kept ~9 KiB per
    name for good): past the limit they are dropped, and those followed are forgotten once
    silent, from the index's sources and from the registry alike."""
    service = make_service(
        bind=["tcp://127.0.0.1:0"], max_discovered_pods=64, discovered_idle_secs=0.2
    )
    await service.start()
    pub = await make_publisher(
        endpoint=service.bound.endpoints[0], connect=True, replay_endpoint=None, topic="kv@s@m"
    )
    sentinel = PodInfo(
        id="s",
        model="m",
        url="http://127.0.0.1:1",
        kv_events=KvEventsConfig(mode="bind", topic="kv@s@m"),
    )
    await follow(service, pub, sentinel)
    await pub.send([store(0)])
    batch = pub.buffer[-1].payload
    most = 0
    for n in range(40_960):
        await pub.raw(live_frames(f"kv@flood-{n}@m".encode(), 0, batch))
        if n % 1024 == 0:
            most = max(most, len(service.following.pods()))
    await pub.send([store(1)])  # read after the flood: the same connection keeps order
    await service.followed.applied(Source("s"), 1, timeout=120)
    assert max(most, len(service.following.pods())) <= 64 + 1
    assert sample(prom, "globalkv_ingest_dropped_total", reason="pod_limit") > 0

    async def forgotten() -> bool:
        followed = [pod.id for pod in service.following.pods()]
        return followed == ["s"] and not await registry.list()

    await await_for(forgotten, timeout=30, what="the silent pods to be forgotten")


async def test_one_huge_bound_batch_is_refused_before_its_events_are_built(
    make_service: ServiceFactory,
    make_publisher: PublisherFactory,
    index: RecordingIndex,
    prom: CollectorRegistry,
) -> None:
    """16 MiB of one-byte events, well within max_message_bytes: millions to decode on
    the event loop, so the count in its header refuses it (the loop's stall, seconds without
    the check here, is not timed: that is for a benchmark)."""
    service = make_service(bind=["tcp://127.0.0.1:0"])
    await service.start()
    pub = await make_publisher(
        endpoint=service.bound.endpoints[0], connect=True, replay_endpoint=None, topic="kv@p@m"
    )
    await pub.wait_subscribed()
    huge = msgpack.packb([1.0, [["x"]] * ((16 << 20) // 3), 0])
    await pub.raw(live_frames(b"kv@p@m", 0, huge))
    pub.next_seq = 1
    await pub.send([store(0)])
    await service.followed.applied(Source("p"), 1, timeout=30)
    assert sample(prom, "globalkv_ingest_dropped_total", reason="bad_batch") == 1


async def test_full_queue_on_the_bound_socket_drops_then_recovers(
    make_service: ServiceFactory,
    make_publisher: PublisherFactory,
    index: RecordingIndex,
    prom: CollectorRegistry,
) -> None:
    service = make_service(bind=["tcp://127.0.0.1:0"], queue_size=1)
    await service.start()
    pub = await make_publisher(
        endpoint=service.bound.endpoints[0], connect=True, replay_endpoint=None, topic="kv@p@m"
    )
    await pub.wait_subscribed()
    index.gate = asyncio.Event()
    for n in range(6):
        await pub.send([store(n)])
    source = Source("p")
    await service.followed.wait(source, lambda state: state.drops > 0)
    worker = service.followed.worker(source)
    assert worker is not None
    # All six must have reached the worker and the queue must have drained before the next
    # batch is sent: a batch that meets a still-full queue is dropped too.
    await service.followed.wait(source, lambda state: worker.received >= 6)
    index.gate.set()
    await service.followed.flush()
    await pub.send([store(6)])
    await service.followed.applied(Source("p"), 6)
    assert sample(prom, "globalkv_ingest_dropped_total", reason="queue_full") >= 1
    applied = index.applied[Source("p")]
    assert applied[0] == 0
    assert applied[-2:] == [-1, 6]


async def test_the_bound_socket_drops_a_batch_past_the_queued_events_bound(
    make_service: ServiceFactory,
    make_publisher: PublisherFactory,
    index: RecordingIndex,
    prom: CollectorRegistry,
) -> None:
    """A decoded event costs several times its wire bytes: what a source may queue is
    bounded in events, a batch larger than the bound passing alone."""
    service = make_service(bind=["tcp://127.0.0.1:0"], max_queued_events=3)
    await service.start()
    pub = await make_publisher(
        endpoint=service.bound.endpoints[0], connect=True, replay_endpoint=None, topic="kv@p@m"
    )
    await pub.wait_subscribed()
    index.gate = asyncio.Event()
    await pub.send([store(0)])
    await index.at_gate.wait()  # batch 0 is being applied: the queue is empty
    await pub.send([store(n) for n in range(1, 6)])  # 5 events, more than 3: alone, it fits
    await pub.send([store(6)])
    source = Source("p")
    await service.followed.wait(source, lambda state: state.drops > 0)
    worker = service.followed.worker(source)
    assert worker is not None
    assert worker.queued_events == 5
    assert sample(prom, "globalkv_ingest_dropped_total", reason="queue_full") == 1
    index.gate.set()
    await service.followed.flush()
    assert worker.queued_events == 0
    assert index.applied[source] == [0, 1]


async def test_a_connected_source_waits_for_room_in_events_before_queueing(
    context: zmq.asyncio.Context, index: RecordingIndex
) -> None:
    metrics = IngestMetrics(CollectorRegistry())
    worker = SourceWorker(
        Source("p"),
        "m",
        None,
        index=index,
        replayer=ReplayClient(context, metrics),
        metrics=metrics,
        resyncs=_NoResyncs(),
        fenced=lambda source: None,
        max_queued_events=3,
        expected=0,
    )
    model = "m"
    await worker.put(await received(0, EventBatch(0.0, [store(n) for n in range(5)]), model))
    assert worker.queued_events == 5  # more than the bound, alone in the queue
    waiting = asyncio.create_task(worker.put(await received(1, EventBatch(0.0, [store(5)]), model)))
    await asyncio.sleep(0)  # one turn: an unbounded queue would have taken it by now
    assert not waiting.done()
    assert worker.queue.qsize() == 1
    running = asyncio.create_task(worker.run())
    try:
        await asyncio.wait_for(worker.applied(1), 10)
        assert waiting.done()
        assert index.applied[Source("p")] == [0, 1]
        assert worker.queued_events == 0
    finally:
        running.cancel()


class _NoResyncs:
    def data_lost(self, source: Source, lost: frozenset[Source] | None) -> None:
        raise AssertionError("no data is lost here")

    def resynced(self, source: Source) -> None:
        raise AssertionError("nothing is resynced here")

    def holding(self, source: Source, reason: str) -> None:
        raise AssertionError("the index refuses nothing here")

    def released(self, source: Source) -> None:
        """Told after every write the index took."""


async def received(seq: int, batch: EventBatch, model: str) -> Received:
    return await border.received(seq, batch, model, 0.0, IngestMetrics(CollectorRegistry()))


async def test_remove_pod_stops_and_clears(
    make_service: ServiceFactory,
    make_publisher: PublisherFactory,
    index: RecordingIndex,
) -> None:
    service, pub = make_service(), await make_publisher()
    await follow(service, pub, pod_for(pub))
    await pub.send([store(0)])
    await service.followed.applied(P0, 0)
    assert await service.following.remove("p0")
    assert index.removed_pods == ["p0"]
    assert service.following.pods() == []
    assert not await service.following.remove("p0")


async def test_flush_returns_when_a_pod_is_removed_with_batches_still_queued(
    make_service: ServiceFactory,
    make_publisher: PublisherFactory,
    index: RecordingIndex,
) -> None:
    service, pub = make_service(), await make_publisher()
    await follow(service, pub, pod_for(pub))
    index.gate = asyncio.Event()
    for n in range(3):
        await pub.send([store(n)])
    await service.followed.wait(P0, lambda state: state.queue_depth >= 2)
    flushing = asyncio.ensure_future(service.followed.flush())  # runs first: it holds the worker
    removing = asyncio.ensure_future(service.following.remove("p0"))
    await asyncio.wait_for(asyncio.gather(flushing, removing), 5)
    assert removing.result()


async def test_queued_batches_are_applied_as_one_group(
    make_service: ServiceFactory,
    make_publisher: PublisherFactory,
    index: RecordingIndex,
    prom: CollectorRegistry,
) -> None:
    service, pub = make_service(max_group=3), await make_publisher()
    await follow(service, pub, pod_for(pub))
    index.gate = asyncio.Event()
    for n in range(6):
        await pub.send([store(n)])
    await service.followed.wait(P0, lambda state: state.queue_depth >= 3)
    index.gate.set()
    await service.followed.applied(P0, 5)
    sizes = [len(b.events) for b in index.batches]
    assert sum(sizes) == 6
    assert max(sizes) == 3
    assert index.applied[P0][-1] == 5
    stored = [e.hashes[0] for b in index.batches for e in b.events]  # type: ignore[union-attr]
    assert stored == [1, 2, 3, 4, 5, 6]
    assert sample(prom, "globalkv_ingest_batches_applied_total", pod="p0") == 6
    assert service.states()["p0"].sources[0].applied == 6
    await asyncio.wait_for(service.followed.flush(), 5)


def _consecutive_ports() -> int:
    """A port p with p + 1 also free (a DP-2 engine publishes on both)."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


async def test_dp_ranks_subscribe_on_port_plus_rank(
    make_service: ServiceFactory,
    make_publisher: PublisherFactory,
    index: RecordingIndex,
) -> None:
    port, replay = _consecutive_ports(), _consecutive_ports()
    ranks = [
        await make_publisher(
            endpoint=f"tcp://127.0.0.1:{port + r}",
            replay_endpoint=f"tcp://127.0.0.1:{replay + r}",
            dp_rank=r,
        )
        for r in range(2)
    ]
    service = make_service()
    pod = PodInfo(
        id="dp",
        model="m",
        dp_size=2,
        kv_events=KvEventsConfig(
            endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{replay}"
        ),
    )
    await service.following.add(pod)
    for pub in ranks:
        await pub.wait_subscribed()
    await ranks[0].send([store(0)])
    await ranks[1].send([store(0)])
    await ranks[1].send([store(1)], live=False)
    await ranks[1].send([store(2)])
    await service.followed.applied(Source("dp", 0), 0)
    await service.followed.applied(Source("dp", 1), 2)
    assert index.applied == {Source("dp", 0): [0], Source("dp", 1): [0, 1, 2]}


async def test_a_source_the_index_could_not_tell_of_is_reset_before_anything_is_applied(
    make_service: ServiceFactory,
    make_publisher: PublisherFactory,
    index: RecordingIndex,
    prom: CollectorRegistry,
) -> None:
    """The engine's buffer no longer starts at 0 and the index may hold anything of the
    source: the catch-up resets it, then applies what the buffer has."""
    service, pub = make_service(), await make_publisher(buffer_steps=1)
    await pub.send([store(0)])
    await pub.send([store(1)])
    index.unavailable = 1
    await follow(service, pub, pod_for(pub))
    await pub.send([store(2)])
    await service.followed.applied(P0, 2)
    assert index.applied[P0] == [-1, 1, 2]
    assert sample(prom, "globalkv_ingest_resets_total", pod="p0", reason="unknown") == 1
