"""The decode-side resolver against the real directory app, with faults injected in between."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from bootstrap.protocol import Coordinate, RankAddress
from bootstrap.resolver import DecodeResolver, DecodeTopology, ResolveError
from bootstrap.server import BootstrapConfig, create_app
from tests.bootstrap.factories import body, instance, rank_port
from tests.support.clock import FakeClock

URL = "http://10.0.0.1:8998"
Fault = Callable[[httpx.Request], httpx.Response | None]


@dataclass
class Directory:
    """The directory app behind a transport that records requests and can inject faults."""

    app: FastAPI
    requests: list[httpx.Request] = field(default_factory=list)
    fault: Fault | None = None

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if self.fault is not None and (response := self.fault(request)) is not None:
            return response
        return await httpx.ASGITransport(self.app).handle_async_request(request)

    def count(self, path: str, snapshot: bool | None = None) -> int:
        def matches(r: httpx.Request) -> bool:
            is_snapshot = r.url.params.get("prefill_dp_rank") == "-1"
            return r.url.path == path and (snapshot is None or snapshot == is_snapshot)

        return sum(1 for r in self.requests if matches(r))

    async def put(self, bodies: list[dict[str, Any]]) -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(self.app)) as client:
            for data in bodies:
                assert (await client.put(f"{URL}/route", json=data)).status_code == 200

    async def room(self, room: int, dp_rank: int) -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(self.app)) as client:
            payload = {"bootstrap_room": room, "dp_rank": dp_rank}
            assert (await client.post(f"{URL}/register_dp_rank", json=payload)).status_code == 200


class Clocked:
    """A fake clock with a sleep that advances it and can run a hook per call."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.delays: list[float] = []
        self.on_sleep: Callable[[int], Any] | None = None

    async def sleep(self, delay: float) -> None:
        self.delays.append(delay)
        self.clock.advance(delay)
        if self.on_sleep is not None:
            result = self.on_sleep(len(self.delays))
            if asyncio.iscoroutine(result):
                await result
        await asyncio.sleep(0)


@pytest.fixture
def directory() -> Directory:
    return Directory(create_app(BootstrapConfig(), clock=FakeClock()))


@pytest.fixture
def time() -> Clocked:
    return Clocked()


@pytest.fixture
async def client(directory: Directory) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.MockTransport(directory.handle)) as client:
        yield client


def resolver_for(client: httpx.AsyncClient, time: Clocked, **kwargs: Any) -> DecodeResolver:
    return DecodeResolver(client, clock=time.clock, sleep=time.sleep, **kwargs)


def addr(dp: int, cp: int, tp: int, pp: int) -> RankAddress:
    return RankAddress(rank_ip="127.0.0.1", rank_port=rank_port(dp, cp, tp, pp))


async def test_resolves_topology_dp_rank_and_addresses(
    directory: Directory, client: httpx.AsyncClient, time: Clocked
) -> None:
    await directory.put(instance(dp=2, tp=4))
    resolver = resolver_for(client, time)
    produced = await resolver.resolve(URL, DecodeTopology(tp_size=2, tp_rank=1), room=7)
    assert produced.dp_rank == 1  # follow_bootstrap_room: 7 % 2
    assert produced.topology.attn_tp_size == 4
    assert [(r.coordinate, r.address, r.is_dummy) for r in produced.ranks] == [
        (Coordinate(1, 0, 2, 0), addr(1, 0, 2, 0), False),
        (Coordinate(1, 0, 3, 0), addr(1, 0, 3, 0), False),
    ]
    assert produced.mapping.required_prefill_response_num == 2


async def test_topology_and_addresses_are_fetched_once_per_address(
    directory: Directory, client: httpx.AsyncClient, time: Clocked
) -> None:
    await directory.put(instance(dp=2, tp=2))
    resolver = resolver_for(client, time)
    decode = DecodeTopology(tp_size=2, tp_rank=0)
    results = await asyncio.gather(*(resolver.resolve(URL, decode, room) for room in range(8)))
    assert {r.dp_rank for r in results} == {0, 1}
    assert directory.count("/route", snapshot=True) == 1
    before = directory.count("/route", snapshot=False)
    await resolver.resolve(URL, decode, 3)
    await resolver.resolve(URL, decode, 4)
    assert directory.count("/route", snapshot=False) == before <= 4


async def test_an_unready_address_is_retried_each_interval_then_fails_naming_it(
    directory: Directory, client: httpx.AsyncClient, time: Clocked
) -> None:
    await directory.put([body(tp=(0, 2))])
    resolver = resolver_for(client, time, max_tries=4, retry_interval=1.0)
    with pytest.raises(ResolveError) as info:
        await resolver.resolve(URL, DecodeTopology(1, 0), room=1)
    assert info.value.stage == "topology"
    assert directory.count("/route", snapshot=True) == 4
    assert time.delays == [1.0, 1.0, 1.0]
    assert str(info.value) == (
        f"bootstrap topology stage failed at {URL}: not available after 4 tries 1s apart; "
        "last answer: HTTP 503: Prefill server not fully registered yet (1 workers registered)."
    )
    assert not resolver.cached(URL)
    assert not info.value.invalid


async def test_an_address_that_becomes_ready_while_retrying_resolves(
    directory: Directory, client: httpx.AsyncClient, time: Clocked
) -> None:
    await directory.put([body(tp=(0, 2))])
    time.on_sleep = lambda n: directory.put([body(tp=(1, 2))]) if n == 2 else None
    resolver = resolver_for(client, time)
    produced = await resolver.resolve(URL, DecodeTopology(2, 1), room=1)
    assert produced.ranks[0].address == addr(0, 0, 1, 0)
    assert directory.count("/route", snapshot=True) == 3


async def test_unreachable_address_fails_at_the_topology_stage(
    directory: Directory, client: httpx.AsyncClient, time: Clocked
) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    directory.fault = refuse
    resolver = resolver_for(client, time, max_tries=2)
    with pytest.raises(ResolveError, match="ConnectError: connection refused") as info:
        await resolver.resolve(URL, DecodeTopology(1, 0), room=1)
    assert info.value.stage == "topology"
    assert info.value.bootstrap_url == URL


async def test_an_invalid_snapshot_fails_at_once(
    directory: Directory, client: httpx.AsyncClient, time: Clocked
) -> None:
    directory.fault = lambda r: httpx.Response(200, json={"attn_tp_size": "many"})
    resolver = resolver_for(client, time)
    with pytest.raises(ResolveError, match="invalid topology snapshot: attn_tp_size") as info:
        await resolver.resolve(URL, DecodeTopology(1, 0), room=1)
    assert info.value.invalid
    assert len(directory.requests) == 1


async def test_an_incompatible_layout_fails_at_the_topology_stage(
    directory: Directory, client: httpx.AsyncClient, time: Clocked
) -> None:
    await directory.put(instance(tp=2))
    resolver = resolver_for(client, time)
    with pytest.raises(ResolveError, match="must divide one another") as info:
        await resolver.resolve(URL, DecodeTopology(3, 0), room=1)
    assert info.value.stage == "topology"


async def test_a_rank_lookup_failure_names_the_rank_stage_and_coordinate(
    directory: Directory, client: httpx.AsyncClient, time: Clocked
) -> None:
    await directory.put(instance(tp=2))
    directory.fault = lambda r: (
        httpx.Response(404, text="Bootstrap info not found")
        if r.url.params.get("target_tp_rank") == "1"
        else None
    )
    resolver = resolver_for(client, time)
    with pytest.raises(ResolveError) as info:
        await resolver.resolve(URL, DecodeTopology(2, 1), room=1)
    assert info.value.stage == "rank"
    assert str(info.value) == (
        f"bootstrap rank stage failed at {URL}: DP0 CP0 TP1 PP0: HTTP 404: Bootstrap info not found"
    )


async def test_dp_rank_rules_in_sglangs_order(
    directory: Directory, client: httpx.AsyncClient, time: Clocked
) -> None:
    await directory.put(instance(dp=4))
    resolver = resolver_for(client, time)
    decode = DecodeTopology(1, 0)
    assert (await resolver.resolve(URL, decode, room=10)).dp_rank == 2
    assert (await resolver.resolve(URL, decode, room=10, explicit_dp_rank=3)).dp_rank == 3
    with pytest.raises(ResolveError, match=r"explicit prefill dp rank 4 outside \[0, 4\)") as info:
        await resolver.resolve(URL, decode, room=10, explicit_dp_rank=4)
    assert info.value.stage == "dp_rank"
    assert directory.count("/query_dp_ranks") == 0


async def test_dp_size_one_is_rank_zero_without_asking(
    directory: Directory, client: httpx.AsyncClient, time: Clocked
) -> None:
    await directory.put(instance(load_balance_method="round_robin"))
    resolver = resolver_for(client, time)
    assert (await resolver.resolve(URL, DecodeTopology(1, 0), room=10)).dp_rank == 0
    assert directory.count("/query_dp_ranks") == 0


async def test_without_follow_the_room_is_polled_until_the_prefill_registers_it(
    directory: Directory, client: httpx.AsyncClient, time: Clocked
) -> None:
    await directory.put(instance(dp=2, load_balance_method="round_robin"))
    time.on_sleep = lambda n: directory.room(11, 0) if n == 3 else None
    resolver = resolver_for(client, time, room_poll_interval=0.05)
    produced = await resolver.resolve(URL, DecodeTopology(1, 0), room=11)
    assert produced.dp_rank == 0
    assert directory.count("/query_dp_ranks") == 4
    assert time.delays == [0.05] * 3


async def test_waiting_rooms_are_asked_for_together(
    directory: Directory, client: httpx.AsyncClient, time: Clocked
) -> None:
    await directory.put(instance(dp=2, load_balance_method="round_robin"))

    async def register_all(n: int) -> None:
        if n == 1:
            for room in (21, 22, 23):
                await directory.room(room, room % 2)

    time.on_sleep = register_all
    resolver = resolver_for(client, time)
    decode = DecodeTopology(1, 0)
    results = await asyncio.gather(*(resolver.resolve(URL, decode, r) for r in (21, 22, 23)))
    assert [r.dp_rank for r in results] == [1, 0, 1]
    bodies = [json.loads(r.content) for r in directory.requests if r.url.path == "/query_dp_ranks"]
    assert bodies == [{"bootstrap_rooms": [21, 22, 23]}] * 2


async def test_a_room_never_registered_fails_at_the_dp_rank_stage(
    directory: Directory, client: httpx.AsyncClient, time: Clocked
) -> None:
    await directory.put(instance(dp=2, load_balance_method="round_robin"))
    resolver = resolver_for(client, time, room_poll_interval=1.0)
    with pytest.raises(ResolveError) as info:
        await resolver.resolve(URL, DecodeTopology(1, 0), room=5, dp_timeout=3.0)
    assert info.value.stage == "dp_rank"
    assert "room 5 got no dp rank registered in time" in str(info.value)
    assert time.clock.now == 1003.0
    assert directory.count("/query_dp_ranks") == 4


async def test_a_room_mapped_outside_dp_size_is_refused(
    directory: Directory, client: httpx.AsyncClient, time: Clocked
) -> None:
    await directory.put(instance(dp=2, load_balance_method="round_robin"))
    await directory.room(8, 5)
    resolver = resolver_for(client, time)
    with pytest.raises(ResolveError, match="mapped to dp rank 5"):
        await resolver.resolve(URL, DecodeTopology(1, 0), room=8)


async def test_stopping_the_resolver_fails_waiting_rooms(
    directory: Directory, client: httpx.AsyncClient
) -> None:
    await directory.put(instance(dp=2, load_balance_method="round_robin"))
    polled = asyncio.Event()

    def note(request: httpx.Request) -> None:
        if request.url.path == "/query_dp_ranks":
            polled.set()

    directory.fault = note
    resolver = DecodeResolver(client, room_poll_interval=60.0)
    waiting = asyncio.create_task(resolver.resolve(URL, DecodeTopology(1, 0), room=5))
    await asyncio.wait_for(polled.wait(), timeout=5)
    await resolver.stop()
    with pytest.raises(ResolveError, match="the resolver stopped"):
        await waiting


async def test_stopping_the_resolver_fails_a_waiting_topology_fetch(
    directory: Directory, client: httpx.AsyncClient
) -> None:
    await directory.put([body(tp=(0, 2))])
    retrying = asyncio.Event()

    async def sleep(delay: float) -> None:
        retrying.set()
        await asyncio.Event().wait()

    resolver = DecodeResolver(client, sleep=sleep)
    waiting = asyncio.create_task(resolver.resolve(URL, DecodeTopology(1, 0), room=1))
    await retrying.wait()
    await resolver.stop()
    with pytest.raises(ResolveError, match="the resolver stopped") as info:
        await waiting
    assert info.value.stage == "topology"


async def test_two_failed_heartbeats_drop_the_cache_and_report_the_address(
    directory: Directory, client: httpx.AsyncClient, time: Clocked
) -> None:
    await directory.put(instance(tp=2))
    lost: list[str] = []
    resolver = resolver_for(client, time, on_address_lost=lost.append)
    decode = DecodeTopology(2, 0)
    await resolver.resolve(URL, decode, room=1)
    assert await resolver.check_health_once() == []
    down = {"on": True}
    directory.fault = lambda r: (
        httpx.Response(502, text="bad gateway") if down["on"] and r.url.path == "/health" else None
    )
    assert await resolver.check_health_once() == []
    assert resolver.cached(URL)
    assert await resolver.check_health_once() == [URL]
    assert lost == [URL]
    assert not resolver.cached(URL)
    down["on"] = False
    await resolver.resolve(URL, decode, room=1)
    assert directory.count("/route", snapshot=True) == 2


async def test_a_successful_heartbeat_resets_the_failure_count(
    directory: Directory, client: httpx.AsyncClient, time: Clocked
) -> None:
    await directory.put(instance())
    resolver = resolver_for(client, time)
    await resolver.resolve(URL, DecodeTopology(1, 0), room=1)
    beats = iter([False, True, False, True])

    def flaky(request: httpx.Request) -> httpx.Response | None:
        if request.url.path != "/health":
            return None
        if next(beats):
            return None
        raise httpx.ReadTimeout("slow", request=request)

    directory.fault = flaky
    for _ in range(4):
        assert await resolver.check_health_once() == []
    assert resolver.cached(URL)


async def test_health_watch_beats_every_interval_until_stopped(
    directory: Directory, client: httpx.AsyncClient
) -> None:
    await directory.put(instance())
    beats: asyncio.Queue[None] = asyncio.Queue()
    gate: asyncio.Queue[None] = asyncio.Queue()
    delays: list[float] = []

    async def sleep(delay: float) -> None:
        delays.append(delay)
        await gate.get()

    def note(request: httpx.Request) -> None:
        if request.url.path == "/health":
            beats.put_nowait(None)

    resolver = DecodeResolver(client, health_interval=5.0, sleep=sleep)
    await resolver.resolve(URL, DecodeTopology(1, 0), room=1)
    directory.fault = note
    resolver.start()
    with pytest.raises(RuntimeError, match="already started"):
        resolver.start()
    for _ in range(2):
        gate.put_nowait(None)
        await asyncio.wait_for(beats.get(), timeout=5)
    await resolver.stop()
    assert delays[:2] == [5.0, 5.0]


async def test_an_invalidation_during_a_fetch_is_not_undone_by_its_result(
    directory: Directory, client: httpx.AsyncClient, time: Clocked
) -> None:
    await directory.put([body(tp=(0, 2))])
    resolver = resolver_for(client, time)

    async def invalidate_then_fill(n: int) -> None:
        if n == 1:
            resolver.invalidate(URL)
            await directory.put([body(tp=(1, 2))])

    time.on_sleep = invalidate_then_fill
    await resolver.resolve(URL, DecodeTopology(2, 0), room=1)
    assert not resolver.cached(URL)
