"""Which Redis failures mean "the index cannot answer now" rather than a bug.

Callers turn these into `IndexUnavailable`, which the gateway answers by routing on load
and the indexer by retrying; anything else is a bug and propagates.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from redis import exceptions as redis_errors

from globalkv.index.base import IndexUnavailable

UNAVAILABLE_REPLIES = ("OOM", "LOADING", "MASTERDOWN", "READONLY", "BUSY", "NOREPLICAS")


@contextmanager
def reachable(what: str) -> Iterator[None]:
    """Turn "Redis cannot answer" into IndexUnavailable; let real bugs through."""
    try:
        yield
    except (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError) as exc:
        reason = f"{type(exc).__name__}: {exc}"  # redis-py's repr leaves out the message
        raise IndexUnavailable(f"redis unreachable while {what}: {reason}") from exc
    except redis_errors.ResponseError as exc:
        if str(exc).startswith(UNAVAILABLE_REPLIES):
            raise IndexUnavailable(f"redis cannot serve {what}: {exc}") from exc
        raise
