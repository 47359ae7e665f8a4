from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import zmq.asyncio

from globalkv.stack.redis_cluster import LocalRedisCluster
from tests.support.redis import RedisServer
from tests.support.redis_cluster import flush, start_cluster

# grpcio's fork handlers are on by default, and this process uses gRPC (tests/entry's
# pickers and clients run in it) before it starts supervised children, which are forked
# with a pre-exec hook (globalkv.stack.children): now and then such a child aborted in
# gRPC's code before its exec ("epoll_wait error: Bad file descriptor", signal 6). With the
# handlers off, no gRPC code runs in a child between fork and exec; no test forks to go on
# using gRPC. The services themselves start no children once they use gRPC.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One real redis-server for the session; tests flush it through `redis_url`."""
    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    import redis

    with redis.Redis(port=redis_server.port) as client:
        client.flushall()
    return redis_server.url


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalRedisCluster]:
    """One real 3-master, 3-replica Redis Cluster for the session (started on first use)."""
    cluster = start_cluster()
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_cluster_url(redis_cluster: LocalRedisCluster) -> str:
    """The session's cluster, emptied: its `redis+cluster://` seed URL."""
    flush(redis_cluster)
    return redis_cluster.url


@pytest.fixture
def context() -> Iterator[zmq.asyncio.Context]:
    """A ZMQ context per test, destroyed without lingering on unsent messages."""
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)
