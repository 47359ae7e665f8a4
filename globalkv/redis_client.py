"""The Redis client every component builds from a URL, single node or Redis Cluster, with
redis-py's retry on lost connections.

URLs: `redis://`, `rediss://` and `unix://` as redis-py reads them, for one Redis; and
`redis+cluster://host:port[,host:port...]/` (`rediss+cluster://` with TLS) for a Redis
Cluster, the hosts being startup nodes: redis-py's `RedisCluster` learns the rest of the
topology from any one of them, follows MOVED/ASK redirections and refreshes its slot map
after a failover. Query options (`?socket_timeout=2`) are redis-py's own either way.

`redis.asyncio.from_url` leaves its connections without a retry (`Retry(NoBackoff(), 0)`),
where a client built with `redis.asyncio.Redis(...)` retries a command that met a
connection error; `connect` gives every client that retry. Before redis-py 8.2 a restart
left every pooled connection dead and the first command on each failed (the index API
answered 503 to lookups after it had resynced); 8.2 reconnects a dead connection as it
leaves the pool. A connection lost while a command is under way (a restart or a failover
under load) still fails that command without a retry on every version, so `connect` keeps
it. Repeating a command is safe for everything we send: reads, idempotent writes, an INCR
whose skipped number nobody misses, and the index's scripts, which refuse a batch already
applied or skip a block write already done.

A cluster client's `aclose` closes every node's connections (`_Cluster`): redis-py's
own does nothing while the client waits to re-read the topology, which a connection
error or a timeout leaves it doing until its next command. After such an error as the
last command, the connections to the other nodes stayed open, and their `ClusterNode`
warned of it whenever the collector met it, in whatever code ran then.
"""

from __future__ import annotations

from typing import Any, TypeAlias
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff

from kvplumbing.addresses import redacted

RETRIES = 3
"""A restart costs one retry per dead connection; Redis down fails within ~0.3 s."""
SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")
"""What `connect` accepts; configuration models validate URLs against it."""

Client: TypeAlias = aioredis.Redis | RedisCluster
"""A client of one Redis or of a Redis Cluster: the index and registry take either."""


class _Cluster(RedisCluster):
    """redis-py's cluster client, whose `aclose` always closes (the module docstring)."""

    async def aclose(self) -> None:
        await super().aclose()
        await self.nodes_manager.aclose()
        await self.nodes_manager.aclose("startup_nodes")


def text(reply: bytes | str) -> str:
    """A Redis reply as text: our clients keep `decode_responses=False` (the index's
    reverse log is binary), so strings come back as bytes."""
    return reply.decode() if isinstance(reply, bytes) else reply


def check_url(url: str) -> str:
    """`url` if `connect` can use it, else ValueError saying why (for config models)."""
    if not url.startswith(SCHEMES):
        shown = redacted(url)
        raise ValueError(f"{shown!r} is not a {', '.join(SCHEMES[:-1])} or {SCHEMES[-1]} URL")
    if is_cluster_url(url):
        cluster_nodes(url)
    return url


def is_cluster_url(url: str) -> bool:
    return url.startswith(("redis+cluster://", "rediss+cluster://"))


def cluster_nodes(url: str) -> list[tuple[str, int]]:
    """The startup nodes of a cluster URL, as (host, port)."""
    netloc = urlsplit(url).netloc.rpartition("@")[2]
    nodes = []
    for part in netloc.split(","):
        host, _, port = part.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"cluster URL {redacted(url)!r}: {part!r} is not host:port")
        nodes.append((host.strip("[]"), int(port)))
    return nodes


def connect(url: str, **options: Any) -> Client:
    """A client for `url` (see the module docstring), its commands retried on connection
    errors."""
    retry = Retry(ExponentialWithJitterBackoff(base=0.01, cap=0.2), RETRIES)
    if not is_cluster_url(url):
        return aioredis.from_url(url, retry=retry, **options)
    nodes = cluster_nodes(url)
    parts = urlsplit(url)
    credentials = parts.netloc.rpartition("@")[0]
    first = f"{nodes[0][0]}:{nodes[0][1]}"
    netloc = f"{credentials}@{first}" if credentials else first
    scheme = parts.scheme.replace("+cluster", "")
    single = urlunsplit((scheme, netloc, parts.path, parts.query, ""))
    startup = [ClusterNode(host, port) for host, port in nodes]
    return _Cluster.from_url(single, startup_nodes=startup, retry=retry, **options)
