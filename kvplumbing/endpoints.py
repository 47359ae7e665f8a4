"""ZMQ endpoints of an engine's DP ranks, computed as vLLM and SGLang compute them.

Each DP rank of an engine runs its own KV-event publisher. The engines derive rank r's
endpoint from the configured one with `offset_endpoint_port` (vLLM's
`vllm/distributed/kv_events.py`, which SGLang's publisher repeats): a tcp port grows by
r, an inproc name gets `_dp{r}`, and any other endpoint (ipc) is refused for r > 0.
The emulated engine binds, and the indexer connects to, exactly those endpoints.

Where vLLM's arithmetic builds an address no engine can be found at, this refuses with
the reason instead: a base port 0 (any free port, so rank r's port is known only once
rank 0 has bound; vLLM would name port r) and a port past 65535.
"""

from __future__ import annotations

from urllib.parse import urlsplit


def endpoint_port(endpoint: str) -> int:
    """The TCP port of `tcp://host:port`; `ValueError` with the endpoint named otherwise."""
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"{endpoint!r} is not a tcp:// endpoint")
    try:
        port = urlsplit(endpoint.replace("*", "0.0.0.0", 1)).port
    except ValueError as exc:
        raise ValueError(f"{endpoint!r} has no valid port: {exc}") from None
    if port is None:
        raise ValueError(f"{endpoint!r} has no port")
    return port


def offset_endpoint(endpoint: str, dp_rank: int) -> str:
    """DP rank `dp_rank`'s endpoint; rank 0's is `endpoint` itself."""
    if dp_rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{dp_rank}"
    if not endpoint.startswith("tcp://"):
        raise ValueError(
            f"cannot offset {endpoint!r} by DP rank {dp_rank}: only tcp:// (port + rank) "
            "and inproc:// (a _dp<rank> suffix) endpoints have one per rank"
        )
    port = endpoint_port(endpoint)
    if port == 0:
        raise ValueError(
            f"cannot offset {endpoint!r} by DP rank {dp_rank}: port 0 is any free port, "
            "so rank r's port is rank 0's bound port + r"
        )
    if port + dp_rank > 65535:
        raise ValueError(f"DP rank {dp_rank} of {endpoint!r} would be past port 65535")
    return f"{endpoint.rsplit(':', 1)[0]}:{port + dp_rank}"
