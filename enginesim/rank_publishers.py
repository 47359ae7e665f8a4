"""The KV-event publishers of one engine, one per DP rank, on port + rank.

Subscribers find rank r's publisher at the rank-0 endpoint's port + r (SGLang's
`port + dp_rank` rule, `kvplumbing.endpoints.offset_endpoint`). With a port of 0 the ranks
still keep that rule: rank 0 takes a free port, the other ranks the ones after it, and when
one of those is taken all are closed and tried again from another free port.
"""

from __future__ import annotations

from collections.abc import Callable

import zmq
import zmq.asyncio

from enginesim.config import KVEventsSettings
from enginesim.metrics import EngineMetrics
from enginesim.publisher import KVEventPublisher, PublisherSettings
from kvplumbing.endpoints import endpoint_port, offset_endpoint

_PORT_TRIES = 20


def _rank_endpoint(base: str, rank: int, first_bound: str | None) -> str:
    """Rank r's endpoint; a port-0 base follows the port rank 0 actually got."""
    if rank and first_bound is not None and base.startswith("tcp://") and endpoint_port(base) == 0:
        host = base.split("://", 1)[1].rsplit(":", 1)[0]
        return f"tcp://{host}:{endpoint_port(first_bound) + rank}"
    return offset_endpoint(base, rank)


def _has_free_port(*endpoints: str | None) -> bool:
    return any(
        e is not None and e.startswith("tcp://") and endpoint_port(e) == 0 for e in endpoints
    )


async def start_rank_publishers(
    events: KVEventsSettings,
    dp: int,
    topic: str,
    context: zmq.asyncio.Context,
    metrics: EngineMetrics,
    *,
    drop: Callable[[], bool],
) -> list[KVEventPublisher]:
    """One started publisher per DP rank on port + rank (none without an endpoint); with
    port 0, retried until rank 0's free port is followed by free ones for the other ranks.
    `drop`: whether to drop a batch (fault injection)."""
    if events.endpoint is None:
        return []
    for _ in range(_PORT_TRIES):
        started: list[KVEventPublisher] = []
        pub_base: str | None = None
        replay_base: str | None = None
        try:
            for index in range(dp):
                replay = events.replay_endpoint
                publisher = KVEventPublisher(
                    PublisherSettings(
                        endpoint=_rank_endpoint(events.endpoint, index, pub_base),
                        replay_endpoint=None
                        if replay is None
                        else _rank_endpoint(replay, index, replay_base),
                        topic=topic,
                        flavor=events.format,
                        dp_rank=index,
                        buffer_steps=events.buffer_steps,
                        hwm=events.hwm,
                    ),
                    context,
                    metrics,
                    drop=drop,
                )
                started.append(publisher)
                await publisher.start()
                if index == 0:
                    pub_base = publisher.bound_endpoint
                    replay_base = publisher.bound_replay_endpoint
        except zmq.ZMQError as exc:
            for publisher in started:
                await publisher.stop()
            if not _has_free_port(events.endpoint, events.replay_endpoint):
                raise OSError(f"cannot bind KV-event sockets: {exc}") from None
            continue
        return started
    raise OSError(f"no {dp} consecutive free ports for KV events")
