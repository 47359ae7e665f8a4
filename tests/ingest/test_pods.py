"""Following pods: honest states, bad input on the bound socket, topic conflicts, removal."""

from __future__ import annotations

import logging

import msgpack
import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from globalkv.index.base import IndexUnavailable, Source
from globalkv.ingest.config import EndpointRefused, IngestConfig
from globalkv.ingest.followed import TopicTaken
from globalkv.ingest.podsync import PodSync
from globalkv.ingest.service import IngestService
from globalkv.metrics import IngestMetrics
from globalkv.registry import KvEventsConfig, MemoryRegistry, PodInfo
from globalkv.wire import live_frames
from tests.ingest.conftest import PublisherFactory, ServiceFactory
from tests.ingest.fakes import RecordingIndex
from tests.ingest.test_service import follow, of_rank, pod_for, store
from tests.support.metrics import sample
from tests.support.net import await_for

P0 = Source("p0", 0)


def bind_pod(pod_id: str, topic: str, replay: str | None = None) -> PodInfo:
    events = KvEventsConfig(mode="bind", topic=topic, replay_endpoint=replay)
    return PodInfo(id=pod_id, model="m", kv_events=events)


async def test_a_connected_pod_is_subscribed_and_says_when_events_arrive(
    make_service: ServiceFactory, make_publisher: PublisherFactory
) -> None:
    service, pub = make_service(), await make_publisher()
    await follow(service, pub, pod_for(pub))
    before = service.states()["p0"]
    assert (before.subscribed, before.receiving) == (True, False)
    assert before.sources[0].received == 0
    await pub.send([store(0)])
    await service.followed.applied(P0, 0)
    after = service.states()["p0"]
    assert (after.subscribed, after.receiving) == (True, True)
    assert after.sources[0].received == 1


async def test_a_bind_pod_listens_but_receives_nothing_before_its_first_event(
    make_service: ServiceFactory, make_publisher: PublisherFactory
) -> None:
    service = make_service(bind=["tcp://127.0.0.1:0"])
    await service.start()
    await service.following.add(bind_pod("b0", "kv@b0@m"))
    before = service.states()["b0"]
    assert (before.subscribed, before.receiving, before.sources) == (True, False, [])
    pub = await make_publisher(
        endpoint=service.bound.endpoints[0], connect=True, replay_endpoint=None, topic="kv@b0@m"
    )
    await pub.wait_subscribed()
    await pub.send([store(0)])
    await service.followed.applied(Source("b0"), 0)
    after = service.states()["b0"]
    assert (after.subscribed, after.receiving) == (True, True)
    assert [s.received for s in after.sources] == [1]


async def test_a_bind_pod_is_not_subscribed_where_nothing_is_bound(
    make_service: ServiceFactory, caplog: pytest.LogCaptureFixture
) -> None:
    service = make_service()
    await service.following.add(bind_pod("b0", "kv@b0@m"))
    state = service.states()["b0"]
    assert (state.subscribed, state.receiving) == (False, False)
    assert "binds none" in caplog.text


async def test_a_subscription_that_dies_is_logged_and_no_longer_subscribed(
    make_service: ServiceFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """An address ZMQ refuses only when connecting (validation keeps such pods out of the
    API: this one is built around it)."""
    service = make_service()
    events = KvEventsConfig.model_construct(
        endpoint="tcp://a b:1", replay_endpoint=None, topic="", mode="connect"
    )
    pod = PodInfo.model_construct(id="p0", model="m", kv_events=events, dp_size=1)
    with caplog.at_level(logging.ERROR):
        await service.following.add(pod)
        followed = service.followed.get("p0")
        assert followed is not None
        (subscription,) = [t for t in followed.tasks if "subscription" in t.get_name()]
        with pytest.raises(zmq.ZMQError, match="Invalid argument"):
            await subscription
    assert not service.states()["p0"].subscribed
    assert "subscription of Source(pod='p0', dp_rank=0) stopped" in caplog.text


async def test_bad_input_on_the_bound_socket_is_counted_and_the_socket_keeps_serving(
    make_service: ServiceFactory,
    make_publisher: PublisherFactory,
    index: RecordingIndex,
    prom: CollectorRegistry,
) -> None:
    service = make_service(bind=["tcp://127.0.0.1:0"], allow_endpoint_schemes=["ipc"])
    await service.start()
    await service.following.add(bind_pod("b0", "kv@b0@m", replay="ipc:///tmp/globalkv-no-offset"))
    pub = await make_publisher(
        endpoint=service.bound.endpoints[0], connect=True, replay_endpoint=None, topic="kv@b0@m"
    )
    await pub.wait_subscribed()
    await pub.raw(live_frames(b"\xff\xfe", 0, msgpack.packb([0.0, [], 0])))
    await pub.raw(of_rank(pub, 4096, [store(0)]))
    await pub.raw(of_rank(pub, 1, [store(0)]))  # rank 1 of an ipc:// replay: no replay for it
    await pub.send([store(0)])
    await service.followed.applied(Source("b0", 0), 0)
    await service.followed.applied(Source("b0", 1), 0)
    assert index.applied == {Source("b0", 0): [0], Source("b0", 1): [0]}
    assert sample(prom, "globalkv_ingest_dropped_total", reason="unknown_topic") == 1
    assert sample(prom, "globalkv_ingest_dropped_total", reason="bad_dp_rank") == 1
    assert service.followed.worker(Source("b0", 1)).replay_endpoint is None  # type: ignore[union-attr]
    assert service.states()["b0"].subscribed


async def test_a_bound_topic_names_one_pod(
    make_service: ServiceFactory, registry: MemoryRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    service = make_service(bind=["tcp://127.0.0.1:0"])
    await service.start()
    await service.following.add(bind_pod("a", "kv@a@m"))
    with pytest.raises(TopicTaken, match="already names pod a"):
        await service.following.add(bind_pod("b", "kv@a@m"))
    renamed = bind_pod("a", "kv@a@m").model_copy(update={"model": "other"})
    await service.following.add(renamed)
    await registry.put(renamed)
    await registry.put(bind_pod("c", "kv@a@m"))
    await registry.put(bind_pod("d", "kv@d@m"))
    await PodSync(registry, service).reconcile()
    assert [p.id for p in service.following.pods()] == ["a", "d"]
    assert "topic 'kv@a@m' already names pod a" in caplog.text


async def test_blocks_of_a_removed_pod_are_cleared_once_the_index_answers(
    make_service: ServiceFactory, make_publisher: PublisherFactory, index: RecordingIndex
) -> None:
    service, pub = make_service(), await make_publisher()
    await follow(service, pub, pod_for(pub))
    index.unavailable = 1
    with pytest.raises(IndexUnavailable):
        await service.following.remove("p0")
    assert service.following.pods() == []
    assert index.removed_pods == []
    await PodSync(MemoryRegistry(), service).reconcile()
    assert index.removed_pods == ["p0"]
    await service.following.clear_removed()
    assert index.removed_pods == ["p0"], "cleared once"


class _FlakyRegistry(MemoryRegistry):
    """Refuses the next `failures` writes, as a Redis that is briefly down."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    async def put(self, pod: PodInfo) -> None:
        if self.failures:
            self.failures -= 1
            raise IndexUnavailable("told to be down")
        await super().put(pod)


async def test_a_discovered_pod_the_registry_missed_is_written_not_dropped(
    make_service: ServiceFactory,
    make_publisher: PublisherFactory,
    index: RecordingIndex,
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = _FlakyRegistry(failures=1)
    service = make_service(registry, bind=["tcp://127.0.0.1:0"])
    await service.start()
    pub = await make_publisher(
        endpoint=service.bound.endpoints[0], connect=True, replay_endpoint=None, topic="kv@d0@m"
    )
    await pub.wait_subscribed()
    await pub.send([store(0)])
    await service.followed.applied(Source("d0"), 0)
    assert "could not write discovered pods" in caplog.text
    await PodSync(registry, service).reconcile()
    assert [p.id for p in service.following.pods()] == ["d0"]
    assert await registry.get("d0") is not None
    assert index.removed_pods == []


class _LosingRegistry(MemoryRegistry):
    """Loses every pod at once, as a Redis that restarted empty."""

    def __init__(self) -> None:
        super().__init__()
        self.lost = False

    def lose_everything(self) -> None:
        self._pods.clear()
        self.lost = True

    async def intact(self) -> bool:
        return not self.lost

    async def mark(self) -> None:
        self.lost = False


async def test_a_notification_after_the_registry_lost_its_data_restores_it_not_the_pod_removed(
    make_service: ServiceFactory, make_publisher: PublisherFactory, index: RecordingIndex
) -> None:
    """A change notice arriving before the periodic reconcile must not read the lost
    registry as "this pod was deleted", or the pod is never followed again."""
    registry = _LosingRegistry()
    service, pub = make_service(registry), await make_publisher()
    pod = pod_for(pub)
    await registry.put(pod)
    await follow(service, pub, pod)
    registry.lose_everything()
    await PodSync(registry, service).sync_one("p0")
    assert [p.id for p in service.following.pods()] == ["p0"]
    assert index.removed_pods == []
    assert await registry.get("p0") == pod, "written back"
    assert await registry.intact()
    await registry.remove("p0")
    await PodSync(registry, service).sync_one("p0")
    assert service.following.pods() == [], "a pod deleted from an intact registry is unfollowed"


async def test_a_bind_address_in_use_fails_at_start_and_leaves_no_socket(
    make_service: ServiceFactory, index: RecordingIndex, context: zmq.asyncio.Context
) -> None:
    first = make_service(bind=["tcp://127.0.0.1:0"])
    await first.start()
    config = IngestConfig(bind=["tcp://127.0.0.1:0", first.bound.endpoints[0]])
    metrics = IngestMetrics(CollectorRegistry())
    second = IngestService(index, MemoryRegistry(), metrics, config, context=context)
    with pytest.raises(zmq.ZMQError, match="in use"):
        await second.start()
    assert second.bound.subscriber is not None
    assert second.bound.subscriber.socket.closed
    await second.stop()


async def test_a_message_over_the_size_limit_never_reaches_ingest(
    make_service: ServiceFactory,
    make_publisher: PublisherFactory,
    index: RecordingIndex,
    prom: CollectorRegistry,
) -> None:
    """ZMQ closes the sender's connection instead; the PUB reconnects, and what it sends
    meanwhile is lost, as in any gap: so batches are sent until one arrives."""
    service = make_service(bind=["tcp://127.0.0.1:0"], max_message_bytes=1024)
    await service.start()
    pub = await make_publisher(
        endpoint=service.bound.endpoints[0], connect=True, replay_endpoint=None, topic="kv@b0@m"
    )
    await pub.wait_subscribed()
    oversized = msgpack.packb([0.0, [], 0]) + b"\x00" * 2048  # not_msgpack, were it read
    await pub.raw(live_frames(b"kv@b0@m", 10**6, oversized))

    async def flowing() -> bool:
        await pub.send([store(0)])
        return Source("b0") in index.applied

    await await_for(flowing, timeout=10, what="batches after the oversized one")
    assert max(index.applied[Source("b0")]) < 10**6
    assert sample(prom, "globalkv_ingest_dropped_total", reason="not_msgpack") == 0


def _ipc_pod(pod_id: str = "p0", *, replay: bool = False) -> PodInfo:
    if replay:
        events = KvEventsConfig(endpoint="tcp://127.0.0.1:5557", replay_endpoint="ipc:///tmp/r")
    else:
        events = KvEventsConfig(endpoint="ipc:///run/engine.sock")
    return PodInfo(id=pod_id, model="m", kv_events=events)


@pytest.mark.parametrize("replay", [False, True])
async def test_a_pod_on_a_non_tcp_endpoint_is_refused_unless_allowed(
    make_service: ServiceFactory, replay: bool
) -> None:
    service = make_service()
    pod = _ipc_pod(replay=replay)
    with pytest.raises(EndpointRefused, match="--allow-endpoint-scheme ipc") as refused:
        service.following.check(pod)
    assert "GLOBALKV_INDEXER_ALLOW_ENDPOINT_SCHEME=ipc" in str(refused.value)
    with pytest.raises(EndpointRefused):
        await service.following.add(pod)
    assert service.following.pods() == []


async def test_an_operator_may_allow_ipc_endpoints(make_service: ServiceFactory) -> None:
    service = make_service(allow_endpoint_schemes=["ipc"])
    pod = _ipc_pod()
    service.following.check(pod)
    await service.following.add(pod)
    assert [p.id for p in service.following.pods()] == ["p0"]
    inproc = PodInfo(id="p1", model="m", kv_events=KvEventsConfig(endpoint="inproc://x"))
    with pytest.raises(EndpointRefused, match="--allow-endpoint-scheme inproc"):
        service.following.check(inproc)


async def test_podsync_follows_the_registry_but_a_refused_pod(
    make_service: ServiceFactory,
    registry: MemoryRegistry,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A gateway writing the shared registry directly cannot make the indexer connect to
    an ipc:// path either."""
    service = make_service()
    await registry.put(_ipc_pod("sneaky"))
    await registry.put(bind_pod("b0", "kv@b0@m"))
    await PodSync(registry, service).reconcile()
    assert [p.id for p in service.following.pods()] == ["b0"]
    assert "not following a pod of the registry: pod sneaky" in caplog.text


async def test_a_refused_pod_is_reported_once_not_at_every_reconciliation(
    make_service: ServiceFactory,
    registry: MemoryRegistry,
    caplog: pytest.LogCaptureFixture,
) -> None:
    sync = PodSync(registry, make_service())
    await registry.put(_ipc_pod("sneaky"))
    for _ in range(3):
        await sync.reconcile()
    assert caplog.text.count("not following a pod of the registry") == 1
    await registry.remove("sneaky")
    await sync.reconcile()
    assert sync.refused == {}
    await registry.put(_ipc_pod("sneaky"))
    await sync.reconcile()
    assert caplog.text.count("not following a pod of the registry") == 2


class _RestartingRegistry(_LosingRegistry):
    """Intact when asked, then empty when listed: Redis restarted between the two calls."""

    async def list(self) -> list[PodInfo]:
        self.lose_everything()
        return await super().list()


async def test_a_registry_lost_between_the_check_and_the_list_is_restored_not_its_pods_removed(
    make_service: ServiceFactory, make_publisher: PublisherFactory, index: RecordingIndex
) -> None:
    registry = _RestartingRegistry()
    service, pub = make_service(registry), await make_publisher()
    pod = pod_for(pub)
    await registry.put(pod)
    await follow(service, pub, pod)
    await PodSync(registry, service).reconcile()
    assert [p.id for p in service.following.pods()] == ["p0"]
    assert index.removed_pods == []
    assert await registry.get("p0") == pod, "written back"
    assert await registry.intact()
