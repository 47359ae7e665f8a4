"""Catching up when a source starts being followed: what the engine published before
anyone listened is asked of its replay buffer at once, in connect mode and for a bind-mode
pod registered with a replay endpoint; a pod first seen on the bound socket without one is
replayed from seq 0 once it registers one."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from globalkv.index.base import Source
from globalkv.registry import KvEventsConfig, PodInfo
from tests.ingest.conftest import PublisherFactory, ServiceFactory
from tests.ingest.fakes import RecordingIndex
from tests.ingest.test_service import P0, follow, pod_for, store
from tests.support.metrics import sample

B0 = Source("b0", 0)


def bind_pod(replay: str | None) -> PodInfo:
    events = KvEventsConfig(mode="bind", topic="kv@b0@m", replay_endpoint=replay)
    return PodInfo(id="b0", model="m", kv_events=events)


async def test_what_an_engine_published_before_it_was_followed_is_applied_at_once(
    make_service: ServiceFactory,
    make_publisher: PublisherFactory,
    index: RecordingIndex,
    prom: CollectorRegistry,
) -> None:
    """The engine stores nothing more after the indexer follows it: without a catch-up no
    live batch would ever reveal the two it published before."""
    service, pub = make_service(), await make_publisher()
    await pub.send([store(0)])
    await pub.send([store(1)])
    await follow(service, pub, pod_for(pub))
    await service.followed.applied(P0, 1)
    assert index.applied[P0] == [0, 1]
    assert sample(prom, "globalkv_ingest_replays_total", pod="p0", outcome="complete") == 1
    assert sample(prom, "globalkv_ingest_replayed_batches_total", pod="p0") == 2


async def test_a_catch_up_continues_where_the_index_stopped(
    make_service: ServiceFactory,
    make_publisher: PublisherFactory,
    index: RecordingIndex,
    prom: CollectorRegistry,
) -> None:
    """A previous indexer applied 0 and 1; the engine published 2 and 3 since."""
    index.applied[P0] = [0, 1]
    service, pub = make_service(), await make_publisher()
    for n in range(4):
        await pub.send([store(n)], live=False)
    await follow(service, pub, pod_for(pub))
    await service.followed.applied(P0, 3)
    assert index.applied[P0] == [0, 1, 2, 3]
    assert sample(prom, "globalkv_ingest_replayed_batches_total", pod="p0") == 2


async def test_a_catch_up_past_what_the_buffer_holds_resets_the_source(
    make_service: ServiceFactory,
    make_publisher: PublisherFactory,
    index: RecordingIndex,
    prom: CollectorRegistry,
) -> None:
    """The index holds the source up to 1; the buffer forgot 2: what 2 removed may still
    be in the index."""
    index.applied[P0] = [0, 1]
    service, pub = make_service(), await make_publisher()
    for n in range(4):
        await pub.send([store(n)], live=False)
    pub.forget(keep=1)
    await follow(service, pub, pod_for(pub))
    await service.followed.applied(P0, 3)
    assert index.applied[P0] == [0, 1, -1, 3]
    assert sample(prom, "globalkv_ingest_resets_total", pod="p0", reason="gap") == 1
    assert sample(prom, "globalkv_ingest_replays_total", pod="p0", outcome="short") == 1


async def test_live_copies_of_caught_up_batches_are_not_taken_for_a_restart(
    make_service: ServiceFactory,
    make_publisher: PublisherFactory,
    index: RecordingIndex,
    prom: CollectorRegistry,
) -> None:
    """The publisher sends a batch live before it answers a replay that holds it: the
    live copy arrives after the catch-up applied it. A batch of a restarted engine below
    the same seq is newer than the last one replayed, and resets the source."""
    service, pub = make_service(), await make_publisher()
    await pub.send([store(0)], live=False)
    await pub.send([store(1)], live=False)
    pub.replay_open.clear()
    await follow(service, pub, pod_for(pub), caught_up=False)
    await pub.send([store(2)])
    await pub.send([store(3)])
    pub.replay_open.set()
    await service.followed.applied(P0, 3)
    assert index.applied[P0] == [0, 1, 2, 3]
    assert not sample(prom, "globalkv_ingest_resets_total", pod="p0", reason="restart")
    pub.restart()
    await pub.send([store(0)])
    await service.followed.wait(P0, lambda state: state.resets == 1)
    assert index.applied[P0] == [0, 1, 2, 3, -1, 0]


async def test_a_bind_pod_registered_with_a_replay_endpoint_catches_up_before_any_event(
    make_service: ServiceFactory,
    make_publisher: PublisherFactory,
    index: RecordingIndex,
) -> None:
    """The engine connected to the bound SUB and stored before this indexer listened, and
    stores nothing more: only its replay buffer holds those batches."""
    service = make_service(bind=["tcp://127.0.0.1:0"])
    await service.start()
    pub = await make_publisher(endpoint=service.bound.endpoints[0], connect=True, topic="kv@b0@m")
    await pub.send([store(0)], live=False)
    await pub.send([store(1)], live=False)
    await service.following.add(bind_pod(pub.bound_replay_endpoint))
    await service.followed.applied(B0, 1)
    assert index.applied[B0] == [0, 1]


async def test_a_pod_first_seen_without_a_replay_endpoint_is_replayed_from_0_once_it_has_one(
    make_service: ServiceFactory,
    make_publisher: PublisherFactory,
    index: RecordingIndex,
    prom: CollectorRegistry,
) -> None:
    """Discovered by its topic, it joins at seq 2 with nothing to replay from; registered
    (by a gateway that read the engine's replay endpoint), its batches 0 and 1 are
    applied, and 2 again after them, in order."""
    service = make_service(bind=["tcp://127.0.0.1:0"])
    await service.start()
    pub = await make_publisher(endpoint=service.bound.endpoints[0], connect=True, topic="kv@b0@m")
    await pub.wait_subscribed()
    await pub.send([store(0)], live=False)
    await pub.send([store(1)], live=False)
    await pub.send([store(2)])
    await service.followed.applied(B0, 2)
    assert index.applied[B0] == [2]
    await service.following.add(bind_pod(pub.bound_replay_endpoint))
    await service.followed.wait(B0, lambda state: state.applied == 3)
    assert index.applied[B0] == [2, 0, 1, 2]
    assert not sample(prom, "globalkv_ingest_resets_total", pod="b0", reason="gap")
    await pub.send([store(3)])
    await service.followed.applied(B0, 3)
    assert index.applied[B0] == [2, 0, 1, 2, 3]
