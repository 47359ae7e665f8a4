"""DP-rank endpoints: the emulated engine binds, and the indexer connects to, one table.

The reference is vLLM's `ZmqEventPublisher.offset_endpoint_port` (SGLang's repeats it):
a tcp port grows by the rank, an inproc name gets `_dp<rank>`, anything else is refused
for a rank above 0. Two rows refuse where vLLM would build an address no engine is at.
"""

from __future__ import annotations

import pytest

from kvplumbing.endpoints import endpoint_port, offset_endpoint

# (endpoint, DP rank, rank's endpoint)
AGREED_WITH_VLLM = [
    ("tcp://*:5557", 0, "tcp://*:5557"),
    ("tcp://*:5557", 2, "tcp://*:5559"),
    ("tcp://10.0.0.5:5557", 1, "tcp://10.0.0.5:5558"),
    ("tcp://engine-0.svc:5557", 3, "tcp://engine-0.svc:5560"),
    ("tcp://[::1]:5557", 1, "tcp://[::1]:5558"),
    ("tcp://*:65534", 1, "tcp://*:65535"),
    ("inproc://kv", 0, "inproc://kv"),
    ("inproc://kv", 1, "inproc://kv_dp1"),
    ("ipc:///tmp/kv", 0, "ipc:///tmp/kv"),
    ("tcp://*:0", 0, "tcp://*:0"),
]

# (endpoint, DP rank, what the refusal says); vLLM's answer in the comment
REFUSED = [
    ("ipc:///tmp/kv", 1, "only tcp://"),  # vLLM: ValueError too
    ("udp://h:5557", 1, "only tcp://"),  # vLLM: ValueError too
    ("tcp://host", 1, "no port"),  # vLLM: ValueError too (int(...) of the host)
    ("tcp://*:0", 1, "port 0 is any free port"),  # vLLM: tcp://*:1, no engine's port
    ("tcp://*:65535", 1, "past port 65535"),  # vLLM: tcp://*:65536, not an address
]


@pytest.mark.parametrize(("endpoint", "rank", "expected"), AGREED_WITH_VLLM)
def test_rank_endpoints_as_vllm_computes_them(endpoint: str, rank: int, expected: str) -> None:
    assert offset_endpoint(endpoint, rank) == expected


@pytest.mark.parametrize(("endpoint", "rank", "reason"), REFUSED)
def test_endpoints_no_rank_can_have_are_refused_with_the_reason(
    endpoint: str, rank: int, reason: str
) -> None:
    with pytest.raises(ValueError, match=reason):
        offset_endpoint(endpoint, rank)


def test_endpoint_port() -> None:
    assert endpoint_port("tcp://*:5557") == 5557
    assert endpoint_port("tcp://[::1]:5557") == 5557
    with pytest.raises(ValueError, match="no port"):
        endpoint_port("tcp://host")
    with pytest.raises(ValueError, match="not a tcp"):
        endpoint_port("ipc:///tmp/x")
