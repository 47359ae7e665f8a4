"""After a Redis restart, the first command on each pooled connection is answered; a
closed cluster client leaves no connection open."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from globalkv import redis_client
from tests.support.net import await_for
from tests.support.redis import RedisServer

pytestmark = pytest.mark.integration


@pytest.fixture
async def own_redis() -> AsyncIterator[RedisServer]:
    server = RedisServer()
    yield server
    server.stop()


async def _failures_after_a_restart(
    server: RedisServer, connect: Callable[[str], aioredis.Redis]
) -> int:
    client = connect(server.url)
    try:
        await asyncio.gather(*(client.ping() for _ in range(4)))  # four pooled connections
        await asyncio.to_thread(server.restart)
        failures = 0
        for _ in range(4):
            pipe = client.pipeline(transaction=False)
            pipe.get("a")
            pipe.hgetall("b")
            try:
                await pipe.execute()
            except aioredis.ConnectionError:
                failures += 1
        return failures
    finally:
        await client.aclose()


async def test_every_pooled_connection_answers_its_first_command_after_a_restart(
    own_redis: RedisServer,
) -> None:
    assert await _failures_after_a_restart(own_redis, redis_client.connect) == 0


async def test_a_command_under_way_when_its_connection_is_lost_is_answered(
    own_redis: RedisServer,
) -> None:
    """What the retry is for on every redis-py version: a connection dropped while a command
    waits on it (a restart under load, a failover) is replaced and the command sent again.
    redis-py 8.2 reconnects a dead connection taken from the pool, not one lost mid-command."""
    client = redis_client.connect(own_redis.url)
    admin = aioredis.from_url(own_redis.url)

    async def blpop_waits() -> bool:
        return b"cmd=blpop" in await admin.execute_command("CLIENT", "LIST")

    waiting = asyncio.ensure_future(client.blpop(["queue"], timeout=10))
    try:
        await await_for(blpop_waits, timeout=10, what="BLPOP under way")
        assert await admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        await await_for(blpop_waits, timeout=10, what="BLPOP sent again")
        await admin.rpush("queue", b"item")
        async with asyncio.timeout(10):
            assert list(await waiting) == [b"queue", b"item"]
    finally:
        waiting.cancel()
        await client.aclose()
        await admin.aclose()


@pytest.mark.parametrize(
    ("url", "nodes"),
    [
        ("redis+cluster://a:7000/", [("a", 7000)]),
        ("redis+cluster://u:pw@a:7000,b:7001/", [("a", 7000), ("b", 7001)]),
        (
            "rediss+cluster://[::1]:7000,10.0.0.2:7001/?socket_timeout=2",
            [("::1", 7000), ("10.0.0.2", 7001)],
        ),
    ],
)
def test_cluster_urls_name_their_startup_nodes(url: str, nodes: list[tuple[str, int]]) -> None:
    assert redis_client.check_url(url) == url
    assert redis_client.cluster_nodes(url) == nodes


@pytest.mark.parametrize(
    "url",
    ["redis+cluster://a/", "redis+cluster://a:7000,b/", "redis+cluster://a:99999/", "http://a:1"],
)
def test_bad_redis_urls_are_refused_with_the_reason(url: str) -> None:
    with pytest.raises(ValueError, match=r"host:port|is not a"):
        redis_client.check_url(url)


async def test_a_cluster_url_gives_a_cluster_client_with_its_options() -> None:
    client = redis_client.connect("redis+cluster://u:pw@a:7000,b:7001/?socket_timeout=2")
    assert isinstance(client, RedisCluster)
    seeds = {(n.host, n.port) for n in client.nodes_manager.startup_nodes.values()}
    assert seeds == {("a", 7000), ("b", 7001)}
    options = client.get_connection_kwargs()
    assert (options["username"], options["password"], options["socket_timeout"]) == ("u", "pw", 2.0)
    await client.aclose()


async def test_a_cluster_client_closes_every_connection_after_a_timed_out_command(
    redis_cluster_url: str,
) -> None:
    """A timeout or connection error leaves redis-py's cluster client waiting to re-read
    the topology, and its own `aclose` then closed nothing: the connections to the other
    masters stayed open until the collector met their `ClusterNode`, which warned then,
    in whatever test ran."""
    client = redis_client.connect(redis_cluster_url, socket_timeout=0.2)
    assert isinstance(client, RedisCluster)
    for i in range(32):  # one connection to every master (not concurrently: on a timeout,
        await client.set(f"key{i}", 1)  # redis-py races to reuse a connection it closes)

    def open_connections() -> int:
        nodes = [*client.get_nodes(), *client.nodes_manager.startup_nodes.values()]
        return sum(c.is_connected for node in nodes for c in node._connections)

    assert open_connections() >= 3
    with pytest.raises(aioredis.TimeoutError):
        await client.blpop(["nothing"], 1)  # blocks past the socket timeout, on every try
    await client.aclose()
    assert open_connections() == 0, "what ClusterNode.__del__ warns of"
