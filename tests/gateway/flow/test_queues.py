"""The flow queues (gateway/flow/queues.py, usage.py): strict order across priority bands,
fair dequeue inside one by decayed usage (lifted for a returning tenant), the bounds on
requests, bytes and tenants, and which request is shed for which."""

from __future__ import annotations

import asyncio

import pytest

from gateway.flow.keys import FlowKey
from gateway.flow.queues import FlowQueues, FlowRequest, Refused, Waiting
from gateway.flow.usage import Usage
from gateway.requests.query import RouteQuery


def waiting(tenant: str, priority: int = 0, tokens: int = 100, size: int = 10) -> Waiting:
    key = FlowKey(tenant, priority, "default", None)
    request = FlowRequest(key, tokens, size, RouteQuery(None))
    return Waiting(request, 0.0, asyncio.get_running_loop().create_future())


def queues(requests: int = 100, size: int = 10_000, tenants: int = 100) -> FlowQueues:
    return FlowQueues(requests, size, Usage(30.0, tenants))


def drain(q: FlowQueues, now: float = 0.0) -> list[str]:
    """Release everything in order, charging each its tokens as flow control does."""
    order = []
    while (head := q.head()) is not None:
        q.remove(head)
        q.usage.charge(head.tenant, head.request.tokens, now)
        order.append(f"{head.tenant}@{head.priority}")
    return order


async def test_bands_are_strict_and_tenants_inside_one_take_turns() -> None:
    q = queues()
    for _ in range(3):
        q.add(waiting("noisy"))
    q.add(waiting("quiet"))
    q.add(waiting("quiet"))
    q.add(waiting("batch", priority=-1))
    q.add(waiting("premium", priority=10))
    assert drain(q) == [
        "premium@10",
        "noisy@0",
        "quiet@0",
        "noisy@0",
        "quiet@0",
        "noisy@0",
        "batch@-1",
    ]


async def test_fair_by_tokens_not_requests_and_usage_counts_the_past() -> None:
    q = queues()
    q.usage.keep("heavy", q.waiting)
    q.usage.charge("heavy", 1000, 0.0)  # served a lot just before
    for _ in range(2):
        q.add(waiting("light", tokens=100))
        q.add(waiting("heavy", tokens=100))
    order = drain(q)
    assert order[:2] == ["light@0", "light@0"], "the tenant served less goes first"
    big = queues()
    for _ in range(3):
        big.add(waiting("long", tokens=900))
    for _ in range(6):
        big.add(waiting("short", tokens=300))
    served = drain(big)
    # by tokens: one 900-token request for three 300-token ones
    assert served[:4].count("short@0") == 3


async def test_usage_halves_every_half_life_and_a_returning_tenant_is_lifted() -> None:
    usage = Usage(10.0, 100)
    usage.charge("a", 800, 0.0)
    assert usage.decayed("a", 10.0) == pytest.approx(400)
    assert usage.decayed("a", 30.0) == pytest.approx(100)
    q = FlowQueues(100, 10_000, Usage(10.0, 100))
    q.usage.charge("busy", 5000, 0.0)
    q.add(waiting("busy"))
    q.add(waiting("busy"))
    # "idle" never used anything: without the lift it would take the band until it
    # had caught up with 5,000 tokens
    q.add(waiting("idle"))
    assert q.usage.total("idle") == pytest.approx(q.usage.total("busy"))
    assert [w.tenant for w in [q.head()]] == ["busy"], "equal usage: the longer waiting first"


async def test_the_usage_scale_rebases_without_changing_the_order() -> None:
    usage = Usage(1.0, 100)
    usage.charge("a", 10, 0.0)
    usage.charge("b", 20, 0.0)
    usage.charge("a", 5, 1000.0)  # 1000 half-lives later: the scale rebased
    assert usage.decayed("a", 1000.0) == pytest.approx(5)
    assert usage.total("b") < usage.total("a")


async def test_bounds_on_requests_and_bytes_shed_the_lowest_band_first() -> None:
    q = queues(requests=3)
    low = waiting("batch", priority=-1)
    mid = waiting("std", priority=0)
    q.add(low)
    q.add(mid)
    q.add(waiting("std", priority=0))
    premium = waiting("premium", priority=10)
    assert q.add(premium) == [low], "the lowest band goes first"
    assert q.add(waiting("gold", priority=10))[0].priority == 0
    with pytest.raises(Refused) as refused:
        q.add(waiting("batch", priority=-1))  # nothing below it to shed
    assert refused.value.reason == "queue_full"
    assert len(q) == 3

    by_bytes = queues(size=100)
    by_bytes.add(waiting("a", priority=0, size=60))
    with pytest.raises(Refused) as too_big:
        by_bytes.add(waiting("b", priority=0, size=50))
    assert too_big.value.reason == "queue_bytes"
    with pytest.raises(Refused):
        by_bytes.add(waiting("c", priority=5, size=101))  # larger than all the queues hold
    shed = by_bytes.add(waiting("c", priority=5, size=90))
    assert [w.tenant for w in shed] == ["a"]
    assert by_bytes.bytes == 90


async def test_inside_a_band_the_tenant_holding_most_is_shed_its_newest_request() -> None:
    q = queues(requests=4)
    hog = [waiting("hog") for _ in range(3)]
    for w in hog:
        q.add(w)
    q.add(waiting("small"))
    shed = q.add(waiting("small"))
    assert shed == [hog[-1]], "the hog's newest, not its oldest"
    # now hog 2, small 2: one more of small's would only move the imbalance
    with pytest.raises(Refused):
        q.add(waiting("small"))
    assert q.add(waiting("third")) == [hog[1]]


async def test_tenants_are_bounded_forgetting_the_idle_ones() -> None:
    q = queues(tenants=2)
    q.add(waiting("a"))
    q.add(waiting("b"))
    with pytest.raises(Refused) as refused:
        q.add(waiting("c"))  # both kept tenants are waiting
    assert refused.value.reason == "tenants"
    head = q.head()
    assert head is not None
    assert head.tenant == "a"
    q.remove(head)
    q.usage.charge(head.tenant, 100, 0.0)
    q.add(waiting("c"))  # "a" has nothing waiting: it is forgotten
    assert len(q.usage) == 2
    assert q.usage.total("a") == 0, "its 100 tokens forgotten with it"


async def test_removing_keeps_the_counts() -> None:
    q = queues()
    first, second = waiting("a", size=7), waiting("a", size=5)
    q.add(first)
    q.add(second)
    assert q.remove(second)
    assert not q.remove(second)
    assert (len(q), q.bytes, q.waiting("a")) == (1, 7, True)
    assert q.remove(first)
    assert (len(q), q.bytes, q.waiting("a"), q.top()) == (0, 0, False, None)
