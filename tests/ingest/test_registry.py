"""Pod records: validation, and both registries' behaviour (memory; Redis on redis_url)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.asyncio.cluster import RedisCluster

from globalkv import redis_client
from globalkv.index.base import IndexUnavailable
from globalkv.registry import (
    KvEventsConfig,
    MemoryRegistry,
    PodInfo,
    PodState,
    RedisRegistry,
    Registry,
    SourceProgress,
)
from tests.support.net import await_for
from tests.support.redis import write_torn

EVENTS = KvEventsConfig(endpoint="tcp://10.0.0.5:5557", replay_endpoint="tcp://10.0.0.5:5558")


@pytest.mark.parametrize("pod_id", ["p0", "10.0.0.5:30000", "[fd00::5]:30000", "engine-0.svc"])
def test_pod_ids_that_name_workers(pod_id: str) -> None:
    assert PodInfo(id=pod_id, kv_events=EVENTS).id == pod_id


@pytest.mark.parametrize("pod_id", ["", "a b", "p/0", "kv@p@m", "x" * 129])
def test_pod_ids_refused(pod_id: str) -> None:
    with pytest.raises(ValidationError, match="id"):
        PodInfo(id=pod_id, kv_events=EVENTS)


def test_model_defaults_to_the_topic_model() -> None:
    pod = PodInfo(id="p0", kv_events=KvEventsConfig(endpoint="tcp://h:1", topic="kv@p0@llama"))
    assert pod.model == "llama"


@pytest.mark.parametrize(
    "kw",
    [
        {"kv_events": {"endpoint": "ipc:///tmp/x"}, "dp_size": 2},
        {"kv_events": {"endpoint": "tcp://*:5557"}},
        {"kv_events": {"mode": "bind"}},
        {"kv_events": {"endpoint": "tcp://h:1"}, "role": "router"},
        {"kv_events": {"endpoint": "tcp://h"}, "dp_size": 2},
        {"kv_events": {"endpoint": "tcp://h:1", "replay_endpoint": "tcp://h:99999"}},
        {"kv_events": {"endpoint": "tcp://a b:1"}},
        {"kv_events": {"endpoint": "tcp://:1"}},
        {"kv_events": {"endpoint": "tcp://h:1/x"}},
        {"kv_events": {"endpoint": "tcp://h:65535"}, "dp_size": 2},
        {"kv_events": {"endpoint": "tcp://h:1"}, "dp_size": 1025},
    ],
)
def test_invalid_pods(kw: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        PodInfo.model_validate({"id": "p0", **kw})


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://10.0.0.5:5557",
        "tcp://[::1]:5557",
        "tcp://[fd00::5]:65535",
        "tcp://engine-0.svc:1",
        "tcp://engine-0.ns.svc.cluster.local.:1",
        "tcp://1engine:1",
        "ipc:///t",
    ],
)
def test_connectable_endpoints(endpoint: str) -> None:
    assert KvEventsConfig(endpoint=endpoint).endpoint == endpoint


# Each is refused by ZMQ only when the SUB connects (or resolves to nothing), after the
# pod would have been accepted.
@pytest.mark.parametrize(
    "host",
    [
        "-",
        "%",
        "a@b",
        ".",
        "..",
        "a..b",
        "-a",
        "a-",
        "a_b",
        "é.com",
        "x" * 64,
        "999.1.1.1",
        "1.2.3",
        "[1.2.3.4]",
        "[fe80::1%eth0]",
        "[::1]x",
    ],
)
@pytest.mark.parametrize("name", ["endpoint", "replay_endpoint"])
def test_unconnectable_tcp_hosts_refused(name: str, host: str) -> None:
    config = {"endpoint": "tcp://h:1", name: f"tcp://{host}:5557"}
    with pytest.raises(ValidationError, match=f"kv_events.{name} .* must be tcp://host:port"):
        KvEventsConfig.model_validate(config)


@pytest.mark.parametrize("port", ["0", "65536", "99999", "", "5557/x"])
def test_tcp_ports_outside_1_to_65535_refused(port: str) -> None:
    with pytest.raises(ValidationError, match="port 1-65535"):
        KvEventsConfig(endpoint=f"tcp://h:{port}")


@pytest.fixture(params=["memory", "redis", "cluster"])
async def registry(request: pytest.FixtureRequest) -> AsyncIterator[Registry]:
    if request.param == "memory":
        yield MemoryRegistry()
        return
    if request.param == "cluster":
        url = request.getfixturevalue("redis_cluster_url")
    else:
        url = request.getfixturevalue("redis_url")
    client = redis_client.connect(url)
    yield RedisRegistry(client, prefix="test")
    await client.aclose()


async def test_put_get_list_remove_and_states(registry: Registry) -> None:
    b = PodInfo(id="b", model="m", kv_events=EVENTS, dp_size=2)
    a = PodInfo(id="a", model="m", kv_events=EVENTS)
    await registry.put(b)
    await registry.put(a)
    assert await registry.get("b") == b
    assert [p.id for p in await registry.list()] == ["a", "b"]
    state = PodState(subscribed=True, sources=[SourceProgress(dp_rank=0, last_seq=3)])
    await registry.put_states({"a": state, "gone": state})
    assert await registry.states() == {"a": state}, "a state is kept only beside its pod"
    assert await registry.remove("a")
    assert not await registry.remove("a")
    assert await registry.get("a") is None
    assert "a" not in await registry.states()


async def test_changes_are_notified(registry: Registry) -> None:
    changes = registry.changes()
    first = asyncio.ensure_future(anext(changes))
    await _listening(registry)
    await registry.put(PodInfo(id="c", kv_events=EVENTS))
    assert await asyncio.wait_for(first, 5) == "c"
    await changes.aclose()


async def _listening(registry: Registry) -> None:
    """Return once `changes()` is subscribed: pub/sub drops what is published before."""
    await asyncio.sleep(0)  # the generator runs up to its subscription
    if isinstance(registry, RedisRegistry):
        channel = registry.channel.encode()

        async def subscribed() -> bool:
            if isinstance(registry.redis, RedisCluster):  # counted by the node subscribed to
                nodes = registry.redis.get_nodes()
                found = [await registry.redis.pubsub_numsub(channel, target_nodes=n) for n in nodes]
                return any(dict(f).get(channel) for f in found)
            counts = dict(await registry.redis.pubsub_numsub(channel))
            return bool(counts.get(channel))

        await await_for(subscribed, timeout=5, what="the registry's subscription")


async def test_redis_registry_knows_when_it_lost_its_data(redis_url: str) -> None:
    client = aioredis.from_url(redis_url)
    registry = RedisRegistry(client, prefix="test")
    assert not await registry.intact()
    await registry.mark()
    await registry.put(PodInfo(id="a", kv_events=EVENTS))
    assert await registry.intact()
    await client.flushall()
    assert not await registry.intact()
    await client.aclose()


async def test_a_connection_closed_under_a_write_is_unavailable(redis_url: str) -> None:
    """redis-py leaks a transport torn down mid-write as an AttributeError from asyncio's
    stream (redis/redis-py#3546): the registry reports it as unavailable, like the index."""
    client = aioredis.Redis.from_url(redis_url, single_connection_client=True)
    registry = RedisRegistry(client, prefix="test")
    await registry.mark()  # the one connection is open
    async with write_torn(client):
        with pytest.raises(IndexUnavailable, match="pod registry unreachable: AttributeError"):
            await registry.put(PodInfo(id="a", kv_events=EVENTS))


async def test_an_attribute_error_of_our_own_still_propagates(redis_url: str) -> None:
    client = aioredis.from_url(redis_url)
    registry = RedisRegistry(client, prefix="test")
    with pytest.raises(AttributeError):
        await registry.put(None)  # type: ignore[arg-type]
    await client.aclose()
