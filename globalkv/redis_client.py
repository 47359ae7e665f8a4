"""The Redis client every component builds from a URL, with redis-py's retry on lost
connections.

`redis.asyncio.from_url` leaves its connections without a retry (`Retry(NoBackoff(), 0)`),
where a client built with `redis.asyncio.Redis(...)` retries a command that met a
connection error. After a Redis restart every pooled connection is dead, and without a
retry the first command on each fails: the index API answered 503 to lookups after it had
resynced. Repeating a command is safe for everything we send: reads, idempotent writes,
an INCR whose skipped number nobody misses, and the apply script, which refuses a batch
it already holds as stale.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff

RETRIES = 3
"""A restart costs one retry per dead connection; Redis down fails within ~0.3 s."""


def connect(url: str, **options: Any) -> aioredis.Redis:
    """`redis.asyncio.from_url(url, **options)`, its commands retried on connection errors."""
    retry = Retry(ExponentialWithJitterBackoff(base=0.01, cap=0.2), RETRIES)
    return aioredis.from_url(url, retry=retry, **options)
