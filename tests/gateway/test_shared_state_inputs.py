"""Gateway replicas sharing state through Redis when what they read there is malformed:
from another version, a replica with a bug, or a stranger with access to the server."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.legs.dispatch import Answer
from gateway.load.pending import PendingPrefixes
from gateway.load.tracker import LoadTracker
from gateway.policies.base import Choice
from gateway.replicas.shared_state import SharedState, member_name
from gateway.replicas.shared_wire import (
    MAX_KEYS_PER_ADD,
    MAX_LOAD,
    MAX_MESSAGE_BYTES,
    MAX_UNSENT_CHANGES,
    MAX_UNSENT_KEYS,
    Load,
    parse_load,
)
from gateway.requests.bodies import parse_request
from globalkv.lookup import LookupResult
from kvplumbing.tasks import cancel_and_wait
from tests.gateway.fakes import (
    Cluster,
    Reading,
    StubLookup,
    StubProbe,
    make_gateway,
    request_of,
)
from tests.support.metrics import sample
from tests.support.net import await_for

INTERVAL = 0.05
MALFORMED = "globalkv_gateway_shared_state_malformed_total"


class Replica:
    def __init__(self, client: aioredis.Redis, name: str) -> None:
        self.loads = LoadTracker(pending=PendingPrefixes(0.0))
        self.registry = CollectorRegistry()
        self.shared = SharedState(
            client, self.loads, member=name, interval=INTERVAL, registry=self.registry, grace_s=0
        )
        self.loads.shared = self.shared
        self.task: asyncio.Task[None] | None = None

    def start(self) -> Replica:
        self.task = asyncio.create_task(self.shared.run())
        return self

    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def in_flight(self, worker: str) -> int:
        return self.loads.candidates([worker])[0].in_flight

    async def listening(self) -> None:
        async with asyncio.timeout(10):  # pub/sub drops what is sent before
            await self.shared.listening.wait()

    def malformed(self, what: str) -> float:
        return sample(self.registry, MALFORMED, what=what)


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
async def replicas(client: aioredis.Redis) -> AsyncIterator[list[Replica]]:
    made: list[Replica] = []
    yield made
    await cancel_and_wait([r.task for r in made if r.task is not None])


async def _stranger_table(client: aioredis.Redis, table: Mapping[Any, str]) -> None:
    """A load table under a member that stays live, as any replica's would."""
    await client.hset("gkv:gw:{gw-x}:load", mapping=table)
    await client.zadd("gkv:gateways", {"gw-x": 10**15})


@pytest.mark.parametrize(
    "raw",
    ["1,2,x", "-1,0,0", "1,2", "1,2,3,4", " 1,2,3", "1_0,2,3", "+1,2,3", "١,2,3", b"\xff,1,1"],
)
def test_a_malformed_load_is_refused(raw: str | bytes) -> None:
    assert parse_load(raw) is None


def test_loads_beyond_any_real_one_are_refused() -> None:
    assert parse_load(f"{MAX_LOAD},0,7") == Load(MAX_LOAD, 0, 7)
    assert parse_load(f"{MAX_LOAD + 1},0,0") is None
    assert parse_load("9" * 400 + ",0,0") is None


async def test_a_malformed_load_costs_only_itself(
    client: aioredis.Redis, replicas: list[Replica]
) -> None:
    """It would have ended the sharing loop and frozen the other replicas' last loads."""
    a, b = Replica(client, "gw-a").start(), Replica(client, "gw-b").start()
    replicas += [a, b]
    ticket = a.loads.start_prefill(Choice("p0", uncached_tokens=100))

    async def b_sees_a() -> bool:
        return b.in_flight("p0") == 1

    await await_for(b_sees_a, timeout=10, what="b to see a's load")
    await _stranger_table(
        client, {"p1": "1,2,not-a-number", "p2": "-5,-1000,-1000", "p3": "2,0,0", b"\xff": "1,1,1"}
    )

    async def b_skips_them() -> bool:
        return b.malformed("load entries") >= 3 and b.in_flight("p3") == 2

    await await_for(b_skips_them, timeout=10, what="b to read gw-x's table")
    a.loads.finish(ticket)

    async def b_sees_a_done() -> bool:
        return b.in_flight("p0") == 0

    await await_for(b_sees_a_done, timeout=10, what="b to see a's request done")
    assert b.running()
    assert b.loads.candidates(["p2"])[0].queued_prefill_tokens == 0  # not -1000


async def test_a_member_name_that_is_not_text_is_skipped(
    client: aioredis.Redis, replicas: list[Replica]
) -> None:
    a, b = Replica(client, "gw-a").start(), Replica(client, "gw-b").start()
    replicas += [a, b]
    await client.zadd("gkv:gateways", {b"\xff\xfe": 10**15})
    a.loads.start_prefill(Choice("p0", uncached_tokens=100))

    async def b_sees_a() -> bool:
        return (
            b.in_flight("p0") == 1 and sample(b.registry, "globalkv_gateway_shared_replicas") == 1
        )

    await await_for(b_sees_a, timeout=10, what="b to see a's load beside the bad member")
    assert b.running()


async def test_a_round_failing_on_a_bug_falls_back_and_the_loop_goes_on(
    client: aioredis.Redis,
    replicas: list[Replica],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    b = Replica(client, "gw-b")
    replicas.append(b)
    real_step = b.shared.step
    raised: list[int] = []

    async def buggy_step() -> None:
        if len(raised) < 2:
            raised.append(1)
            raise RuntimeError("a bug in a round")
        await real_step()

    monkeypatch.setattr(b.shared, "step", buggy_step)
    b.start()

    async def shares_again() -> bool:
        return sample(b.registry, "globalkv_gateway_shared_state_available") == 1

    await await_for(shares_again, timeout=10, what="b to share again after the bug")
    assert sample(b.registry, "globalkv_gateway_shared_state_failures_total") == 2
    logged = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(logged) == 1  # the same failure twice in a row: its traceback once


def _message(*changes: object, origin: object = "gw-x") -> str:
    return json.dumps({"from": origin, "changes": list(changes)})


POISON = {
    "infinite serial": '{"from": "gw-x", "changes": [["add", Infinity, "p0", [1], null]]}',
    "infinite key": '{"from": "gw-x", "changes": [["add", 1, "p0", [Infinity], null]]}',
    "NaN serial": '{"from": "gw-x", "changes": [["done", NaN, false]]}',
    "nested too deep": "[" * 100_000,
    "too long": " " * (MAX_MESSAGE_BYTES + 1),
    "not an object": "[1, 2]",
    "origin not text": _message(["add", 1, "p0", [1], None], origin=7),
    "changes not a list": '{"from": "gw-x", "changes": {"add": 1}}',
    "worker not text": _message(["add", 1, ["p0"], [1], None]),
    "keys not a list": _message(["add", 1, "p0", {"1": 1}, None]),
    "key a float": _message(["add", 1, "p0", [1.5], None]),
    "key negative": _message(["add", 1, "p0", [-1], None]),
    "key beyond 64 bits": _message(["add", 1, "p0", [1 << 64], None]),
    "serial a bool": _message(["add", True, "p0", [1], None]),
    "computed not a bool": _message(["done", 1, "yes"]),
    "short change": _message(["add", 1]),
    "change not a list": _message("add"),
}


@pytest.mark.parametrize("poison", POISON.values(), ids=POISON.keys())
async def test_a_malformed_pending_message_is_skipped_and_the_others_still_heard(
    client: aioredis.Redis, replicas: list[Replica], poison: str
) -> None:
    """A RecursionError or OverflowError out of one message would have ended the listener,
    `listening` still set, and no replica's pending prompt would have been heard again."""
    a, b = Replica(client, "gw-a").start(), Replica(client, "gw-b").start()
    replicas += [a, b]
    await a.listening()
    await b.listening()
    await client.publish("gkv:gw:pending", poison)

    async def skipped() -> bool:
        return b.malformed("pending messages") + b.malformed("pending changes") == 1

    await await_for(skipped, timeout=10, what="b to skip the message")
    assert b.shared.listening.is_set()
    a.loads.start_prefill(Choice("p0", uncached_tokens=100), [11, 12])

    async def b_hears_a() -> bool:
        return "p0" in b.loads.pending_blocks([11, 12])

    await await_for(b_hears_a, timeout=10, what="b to hear a's pending prompt after it")
    assert b.shared._remote.table.keys == 2  # nothing of the poison was kept


@pytest.mark.parametrize("rank", [-1, "0", 1.5, True, [0]])
async def test_a_remote_dp_rank_that_is_not_one_is_dropped(
    client: aioredis.Redis, rank: object
) -> None:
    """The router would have drawn a room for it and failed the request (a negative rank
    is below any dp_size; a string or a float breaks the arithmetic)."""
    cluster, probe = Cluster(), StubProbe()
    topology = {"dp_size": 4, "follow_bootstrap_room": True}
    probe.readings["http://10.0.0.1:8998"] = Reading(topology=topology)
    probe.readings["http://10.0.0.2:8999"] = Reading(topology=topology)
    keys = [101, 102, 103]
    result = LookupResult(block_size=4, blocks=3, pods=[], keys=keys)
    gateway = await make_gateway(cluster, probe=probe, lookup=StubLookup(result))
    try:
        shared = SharedState(
            client, gateway.loads, member="gw-b", interval=INTERVAL, registry=CollectorRegistry()
        )
        gateway.loads.shared = shared
        for serial, worker in enumerate(("10.0.0.1:30001", "10.0.0.2:30001")):
            shared._apply(_message(["add", serial, worker, keys, rank]))
            assert gateway.loads.pending_blocks(keys)[worker].dp_rank is None
        tokens = list(range(13))
        request = request_of(parse_request("generate", {"input_ids": tokens}))
        await gateway.router.look_up(request.query)
        answer = await gateway.dispatcher.forward(request)
        assert isinstance(answer, Answer)
        assert answer.status == 200
    finally:
        await gateway.close(drain_secs=0)


async def test_a_remote_dp_rank_is_kept(client: aioredis.Redis) -> None:
    tracker = LoadTracker(pending=PendingPrefixes(0.0))
    shared = SharedState(
        client, tracker, member="gw-b", interval=INTERVAL, registry=CollectorRegistry()
    )
    tracker.shared = shared
    shared._apply(_message(["add", 0, "p0", [11], 3], ["add", 1, "p1", [11], None]))
    assert tracker.pending_blocks([11])["p0"].dp_rank == 3
    assert tracker.pending_blocks([11])["p1"].dp_rank is None


async def test_listening_is_cleared_once_the_listener_stops(
    client: aioredis.Redis, replicas: list[Replica]
) -> None:
    b = Replica(client, "gw-b").start()
    await b.listening()
    assert b.task is not None
    await cancel_and_wait([b.task])
    assert not b.shared.listening.is_set()


async def test_a_dead_replica_s_pending_prompts_are_forgotten(
    client: aioredis.Redis, replicas: list[Replica]
) -> None:
    a, b = Replica(client, "gw-a").start(), Replica(client, "gw-b").start()
    replicas += [a, b]
    await a.listening()
    await b.listening()
    a.loads.start_prefill(Choice("p0", uncached_tokens=100), [11, 12])

    async def b_hears_a() -> bool:
        return "p0" in b.loads.pending_blocks([11, 12])

    await await_for(b_hears_a, timeout=10, what="b to hear a's pending prompt")
    assert a.task is not None
    await cancel_and_wait([a.task])  # killed: no "done" ever comes, nor a leave()

    async def b_forgets_a() -> bool:
        return not b.loads.pending_blocks([11, 12])

    await await_for(b_forgets_a, timeout=10, what="b to forget a's pending prompt")
    assert sample(b.registry, "globalkv_gateway_shared_state_available") == 1


def test_a_restarted_replica_is_a_new_origin() -> None:
    """Same host name and process id (a restarted container's PID 1), same port: its serials
    start again from 0 and must not be taken for its predecessor's."""
    first, second = member_name(8000), member_name(8000)
    assert first != second
    assert first.startswith(f"{socket.gethostname()}-{os.getpid()}-8000-")


async def test_a_failed_round_sends_its_changes_with_the_next(
    redis_url: str, replicas: list[Replica], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round whose PUBLISH timed out had dropped the changes it took: the others never
    heard the "done" and kept the prompt pending for as long as its replica lived."""
    a_client, b_client = aioredis.from_url(redis_url), aioredis.from_url(redis_url)
    try:
        a, b = Replica(a_client, "gw-a").start(), Replica(b_client, "gw-b").start()
        replicas += [a, b]
        await a.listening()
        await b.listening()
        ticket = a.loads.start_prefill(Choice("p0", uncached_tokens=100), [11, 12])

        async def b_hears_a() -> bool:
            return "p0" in b.loads.pending_blocks([11, 12])

        await await_for(b_hears_a, timeout=10, what="b to hear a's pending prompt")
        real_publish = a_client.publish
        failed: list[int] = []

        async def publish_timing_out_once(*args: Any, **kwargs: Any) -> Any:
            if not failed:
                failed.append(1)
                raise RedisTimeoutError("Timeout reading from socket")
            return await real_publish(*args, **kwargs)

        monkeypatch.setattr(a_client, "publish", publish_timing_out_once)
        a.loads.finish(ticket, computed=False)

        async def b_hears_it_done() -> bool:
            return not b.loads.pending_blocks([11, 12])

        await await_for(b_hears_it_done, timeout=10, what="b to hear a's done after the failure")
        assert failed
        assert sample(a.registry, "globalkv_gateway_shared_state_failures_total") == 1
    finally:
        await cancel_and_wait([r.task for r in replicas if r.task is not None])
        await a_client.aclose()
        await b_client.aclose()


async def test_what_a_failed_round_keeps_for_the_next_is_bounded(client: aioredis.Redis) -> None:
    b = Replica(client, "gw-b")
    for serial in range(MAX_UNSENT_CHANGES + 10):
        b.shared.answered(serial, computed=True)
    b.shared._keep_unsent(b.shared._outbox[:5])  # a failed round's five, before the rest
    assert len(b.shared._outbox) == MAX_UNSENT_CHANGES
    assert b.shared._outbox[-1] == ["done", MAX_UNSENT_CHANGES + 9, True]  # the newest kept
    b.shared._outbox = []
    keys = list(range(MAX_KEYS_PER_ADD))
    for serial in range(MAX_UNSENT_KEYS // MAX_KEYS_PER_ADD + 3):
        b.shared.sent(serial, "p0", keys, None)
    b.shared._keep_unsent([["done", 0, True]])
    assert sum(len(c[3]) for c in b.shared._outbox if c[0] == "add") == MAX_UNSENT_KEYS
