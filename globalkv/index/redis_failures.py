"""Which Redis failures mean "the index cannot answer now" rather than a bug.

Callers turn these into `IndexUnavailable`, which the gateway answers by routing on load
and the indexer by retrying; anything else is a bug and propagates.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from contextlib import contextmanager

from redis import exceptions as redis_errors

from globalkv.index.base import IndexUnavailable

NON_LOCAL = "Script attempted to access a non local key"
"""A cluster master's refusal of a key whose slot it does not serve (now): a slot moved
since the caller grouped its keys (`redis_shards.Shards.gather` turns it into `SlotMoved`)."""
UNAVAILABLE_REPLIES = (
    "OOM",
    "LOADING",
    "MASTERDOWN",
    "READONLY",
    "BUSY",
    "NOREPLICAS",
    "CLUSTERDOWN",
    "TRYAGAIN",
    NON_LOCAL,
)
UNAVAILABLE_ERRORS: tuple[type[redis_errors.ResponseError], ...] = (
    redis_errors.OutOfMemoryError,
    redis_errors.ReadOnlyError,
    redis_errors.TryAgainError,
)
"""The same replies as redis-py raises them: it strips the code (`OOM`, `READONLY`,
`TRYAGAIN`) from the message of the classes it maps them to, so the message alone cannot
tell them. A full Redis (`maxmemory` with `noeviction`) refuses every script that may
write: held and retried like an outage, never dropped as a bug."""
_TRANSPORT_FILES = (
    "redis/asyncio/connection.py",
    "asyncio/streams.py",
    "asyncio/selector_events.py",
)
"""Where redis-py's asyncio client leaks a connection closed under a write as a TypeError or
AttributeError instead of a ConnectionError (redis/redis-py#3546, #4287; seen here when
a cluster master was killed)."""


@contextmanager
def reachable(what: str) -> Iterator[None]:
    """Turn "Redis cannot answer" into IndexUnavailable; let real bugs through."""
    try:
        yield
    except (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError) as exc:
        reason = f"{type(exc).__name__}: {exc}"  # redis-py's repr leaves out the message
        raise IndexUnavailable(f"redis unreachable while {what}: {reason}") from exc
    except (redis_errors.ClusterError, redis_errors.SlotNotCoveredError) as exc:
        raise IndexUnavailable(f"redis cluster cannot serve {what}: {exc!r}") from exc
    except redis_errors.ResponseError as exc:
        if isinstance(exc, UNAVAILABLE_ERRORS) or str(exc).startswith(UNAVAILABLE_REPLIES):
            raise IndexUnavailable(f"redis cannot serve {what}: {exc}") from exc
        raise
    except (AttributeError, TypeError) as exc:
        if not closed_under_a_write(exc):
            raise
        raise IndexUnavailable(f"redis connection closed while {what}: {exc!r}") from exc


CONNECTION_FAILURES = (redis_errors.RedisError, OSError, AttributeError, TypeError)
"""What a caller that treats every Redis error alike catches, then sorts with `redis_failed`."""


def redis_failed(exc: BaseException) -> bool:
    """Whether `exc` (one of `CONNECTION_FAILURES`) is Redis failing, not our code: any
    redis-py error or OSError, or a connection closed under a write (module constants)."""
    return isinstance(exc, redis_errors.RedisError | OSError) or closed_under_a_write(exc)


@contextmanager
def any_failure_unavailable(message: str) -> Iterator[None]:
    """Every Redis failure (`redis_failed`) as `IndexUnavailable("<message>: <error>")`,
    for callers with no reply worth telling apart (the registry, the leases)."""
    try:
        yield
    except CONNECTION_FAILURES as exc:
        if not redis_failed(exc):
            raise
        reason = f"{type(exc).__name__}: {exc}"  # redis-py's repr leaves out the message
        raise IndexUnavailable(f"{message}: {reason}") from exc


def closed_under_a_write(exc: BaseException) -> bool:
    """The error was raised inside the client's transport, not by our code."""
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and frames[-1].filename.endswith(_TRANSPORT_FILES)
