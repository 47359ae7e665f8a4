"""Requests answered by callbacks (`gateway.serving.relay`) on real sockets, end to end.

The gateway's own `HttpServer` over its own pool (`PooledUpstream`) to scripted loopback
workers, raw-socket clients: where `Inference.begin` hands a request to a `Relay`. Each
test checks through `relayed` that the relay answered (or, for HTTP/1.0 and a bad body,
that it did not), and what the task path would give: statuses, bodies, head lines,
metrics, retries, breaker records, loads.
"""

from __future__ import annotations

import asyncio
import gc
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest

from gateway.http.connection import Connection
from gateway.http.connections import ConnectionPool
from gateway.http.reply import Reply
from gateway.http.server import HttpServer
from gateway.http.upstream import PooledUpstream
from gateway.legs.deadline import Progress
from gateway.legs.relayed import RelayedPair
from gateway.requests.request import Request
from gateway.serving.app import create_app
from gateway.serving.inference import Inference
from gateway.serving.relay import Relay
from gateway.serving.service import Gateway
from gateway.settings.edge import AdmissionConfig, EdgeConfig
from gateway.settings.workers import RetryConfig, WorkerSpec
from gateway.workers.pool import Worker as PoolWorker
from globalkv.lookup import LookupResult, PodHit
from tests.gateway.fakes import Cluster, StubLookup, config, make_gateway, sample
from tests.gateway.scripted import read_request, running
from tests.gateway.test_server import connected, post, read_answer, read_chunk
from tests.support.net import until

STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
LAST_CHUNK = b"0\r\n\r\n"
GENERATE = post("/generate", {"input_ids": [1, 2, 3]})
WAIT = 10.0
"""Bound on every wait for something the gateway or a worker does."""


async def answer_of(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    return await asyncio.wait_for(read_answer(reader), WAIT)


async def piece_of(reader: asyncio.StreamReader) -> bytes:
    return await asyncio.wait_for(read_chunk(reader), WAIT)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def reply(status: int, body: bytes) -> bytes:
    head = b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
    return head % (status, len(body)) + body


Script = Callable[
    ["Worker", asyncio.StreamReader, asyncio.StreamWriter, dict[str, Any]], Awaitable[None]
]


class Worker:
    """A scripted loopback worker: each request recorded (head lines, JSON body), then
    answered by `script`, on keep-alive connections."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.heads: list[dict[str, str]] = []
        self.bodies: list[dict[str, Any]] = []
        self.arrived = asyncio.Event()
        self.gone = asyncio.Event()
        """The gateway closed a connection whose answer this worker was still giving."""
        self.url = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, body = await read_request(reader)
            lines = head.decode().split("\r\n")[1:]
            self.heads.append(
                {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines if x)}
            )
            self.bodies.append(json.loads(body))
            self.arrived.set()
            await self.script(self, reader, writer, self.bodies[-1])
            await writer.drain()

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


async def until_closed(worker: Worker, reader: asyncio.StreamReader) -> None:
    """Answer nothing until the gateway closes the connection (then `worker.gone`)."""
    await reader.read()
    worker.gone.set()
    raise ConnectionResetError  # this connection is over


async def hang(worker: Worker, reader: asyncio.StreamReader, *_: Any) -> None:
    await until_closed(worker, reader)


async def prefilled(worker: Worker, reader: Any, writer: asyncio.StreamWriter, _: Any) -> None:
    writer.write(reply(200, b"{}"))


async def decoded(worker: Worker, reader: Any, writer: asyncio.StreamWriter, body: Any) -> None:
    """The decode's whole answer: the ids it was asked for and its room, by port."""
    answer = {"ids": body.get("input_ids"), "room": body["bootstrap_room"], "by": worker.port}
    writer.write(reply(200, json.dumps(answer).encode()))


def first_then(first: int, role: list[Worker], then: Script) -> Script:
    """The first request to any worker of `role` answered `first`, every other by `then`."""

    async def script(worker: Worker, reader: Any, writer: asyncio.StreamWriter, body: Any) -> None:
        if sum(len(w.bodies) for w in role) == 1:
            writer.write(reply(first, b'{"error": "kv pool exhausted"}'))
        else:
            await then(worker, reader, writer, body)

    return script


@dataclass
class Setup:
    gateway: Gateway
    server: HttpServer

    def worker(self, scripted: Worker) -> PoolWorker:
        found = self.gateway.pool.get(scripted.url.split("//")[1])
        assert found is not None
        return found

    def used(self, role: Sequence[Worker]) -> list[Worker]:
        return [w for w in role if w.bodies]

    def requests(self, status: int, endpoint: str = "generate") -> float:
        labels = {"endpoint": endpoint, "status": str(status)}
        return sample(self.gateway, "globalkv_gateway_requests_total", **labels)

    async def settled(self) -> None:
        """Prefills that outlived their request ended; no load left anywhere."""
        await asyncio.wait_for(self.gateway.calls.drain(), WAIT)
        assert all(v.in_flight == 0 for v in self.gateway.loads.loads.values())

    def failures(self) -> int:
        return sum(w.breaker.stats().total_failures for w in self.gateway.pool)


@asynccontextmanager
async def gateway_on(
    prefills: Sequence[Worker],
    decodes: Sequence[Worker],
    lookup: Any = None,
    **overrides: Any,
) -> AsyncIterator[Setup]:
    """The gateway's server over `prefills` and `decodes` (round robin among prefills,
    unless `prefill_policy` says otherwise; `lookup`: the index it asks)."""
    async with AsyncExitStack() as stack:
        for worker in (*prefills, *decodes):
            worker.url = (await stack.enter_async_context(running(worker.handle))).url
        pool = ConnectionPool()
        stack.push_async_callback(pool.aclose)
        specs = [
            WorkerSpec(url=w.url, role="prefill", bootstrap_port=8998 + i)
            for i, w in enumerate(prefills)
        ]
        cfg = config(
            prefill=specs,
            decode=[WorkerSpec(url=w.url, role="decode") for w in decodes],
            prefill_policy=overrides.pop("prefill_policy", "round_robin"),
            **overrides,
        )
        gateway = await make_gateway(Cluster(), cfg, upstream=PooledUpstream(pool), lookup=lookup)
        server = HttpServer(Inference(gateway), create_app(gateway, run_monitor=False))
        await server.start("127.0.0.1", 0)
        stack.push_async_callback(server.shutdown, 5)
        yield Setup(gateway, server)


@pytest.fixture
def relayed(monkeypatch: pytest.MonkeyPatch) -> list[Relay]:
    """Every relay started: a test of the relay fails if requests stopped being relayed."""
    started: list[Relay] = []
    start = Relay.start

    def counted(self: Relay) -> None:
        started.append(self)
        start(self)

    monkeypatch.setattr(Relay, "start", counted)
    return started


def pair() -> tuple[list[Worker], list[Worker]]:
    return [Worker(prefilled), Worker(prefilled)], [Worker(decoded)]


async def test_a_whole_answer_is_relayed_with_both_workers_bound_to_one_room(
    relayed: list[Relay],
) -> None:
    prefills, decodes = pair()
    async with gateway_on(prefills, decodes) as setup, connected(setup.server) as (reader, writer):
        writer.write(GENERATE)
        status, headers, body = await answer_of(reader)
        await setup.settled()
        assert len(relayed) == 1, "answered by a relay"
        (prefill,), (decode,) = setup.used(prefills), decodes
        assert status == 200
        answer = json.loads(body)
        assert answer["ids"] == [1, 2, 3]
        assert answer["by"] == decode.port
        request_id = headers["x-request-id"]
        sent = (prefill.bodies[0], decode.bodies[0])
        assert sent[0]["bootstrap_room"] == sent[1]["bootstrap_room"] == answer["room"]
        port = 8998 + prefills.index(prefill)
        for body_sent in sent:
            assert (body_sent["bootstrap_host"], body_sent["bootstrap_port"]) == ("127.0.0.1", port)
        assert prefill.heads[0]["x-request-id"] == decode.heads[0]["x-request-id"] == request_id
        assert setup.requests(200) == 1
        for worker in (prefill, decode):
            stats = setup.worker(worker).breaker.stats()
            assert (stats.total_successes, stats.total_failures) == (1, 0)


async def test_a_clients_request_id_and_trace_context_reach_both_workers_and_cors_is_answered(
    relayed: list[Relay],
) -> None:
    prefills, decodes = pair()
    origin = "https://app.example"
    trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    edge = EdgeConfig(cors_allowed_origins=[origin])
    request = post(
        "/generate",
        {"text": "x"},
        "x-request-id: client-7",
        f"traceparent: {trace}",
        f"origin: {origin}",
    )
    setup_made = gateway_on(prefills, decodes, edge=edge)
    async with setup_made as setup, connected(setup.server) as (reader, writer):
        writer.write(request)
        status, headers, _ = await answer_of(reader)
        assert len(relayed) == 1
        assert (status, headers["x-request-id"]) == (200, "client-7")
        assert headers["access-control-allow-origin"] == origin
        for worker in (*setup.used(prefills), *decodes):
            assert (worker.heads[0]["x-request-id"], worker.heads[0]["traceparent"]) == (
                "client-7",
                trace,
            )


@pytest.fixture
def no_collections() -> Iterator[None]:
    """Collections off for the test, from an empty start: what they would have freed stays
    until `cyclic_garbage` looks."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def cyclic_garbage() -> list[object]:
    """What a collection frees now: objects only it frees (parts of reference cycles)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return list(gc.garbage)
    finally:
        gc.garbage.clear()
        gc.set_debug(0)


async def test_answered_requests_leave_nothing_for_the_garbage_collector(
    relayed: list[Relay], no_collections: None
) -> None:
    """Whole and streamed answers: each request's objects are freed as its answer ends, so
    young collections, set rare (`tune_garbage_collection`), find nothing to free."""

    async def streaming(worker: Worker, reader: Any, writer: asyncio.StreamWriter, _: Any) -> None:
        writer.write(STREAM_HEAD + chunk(b"data: 1\n\n") + LAST_CHUNK)

    prefills, decodes = pair()
    streams = [Worker(streaming)]
    async with gateway_on(prefills, decodes) as setup, connected(setup.server) as (reader, writer):
        for _ in range(3):
            writer.write(GENERATE)
            assert (await answer_of(reader))[0] == 200
        await setup.settled()
    async with gateway_on(prefills, streams) as setup, connected(setup.server) as (reader, writer):
        for _ in range(3):
            writer.write(post("/generate", {"input_ids": [1], "stream": True}))
            assert (await answer_of(reader))[0] == 200
        await setup.settled()
    assert len(relayed) == 6
    relayed.clear()
    kinds = (Relay, RelayedPair, Progress, Request, Reply)
    cyclic = sorted(type(o).__name__ for o in cyclic_garbage() if isinstance(o, kinds))
    assert cyclic == [], f"freed only by the garbage collector: {cyclic}"


async def test_a_stream_passes_each_piece_as_it_arrives_and_keeps_the_connection(
    relayed: list[Relay],
) -> None:
    pieces: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def streaming(worker: Worker, reader: Any, writer: asyncio.StreamWriter, _: Any) -> None:
        writer.write(STREAM_HEAD)
        while (piece := await pieces.get()) is not None:
            writer.write(chunk(piece))
            await writer.drain()
        writer.write(LAST_CHUNK)

    prefills, decodes = [Worker(prefilled), Worker(prefilled)], [Worker(streaming)]
    async with gateway_on(prefills, decodes) as setup, connected(setup.server) as (reader, writer):
        writer.write(post("/generate", {"input_ids": [1], "stream": True}))
        pieces.put_nowait(b"data: 1\n\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
        assert head.startswith(b"HTTP/1.1 200 ")
        assert b"transfer-encoding: chunked" in head
        assert b"text/event-stream" in head
        assert b"x-request-id: " in head
        assert await piece_of(reader) == b"data: 1\n\n"
        pieces.put_nowait(b"data: 2\n\n")  # sent only once the first piece was read
        assert await piece_of(reader) == b"data: 2\n\n"
        pieces.put_nowait(None)
        assert await asyncio.wait_for(reader.readexactly(5), WAIT) == LAST_CHUNK
        for piece in (b"data: a\n\n", None):
            pieces.put_nowait(piece)
        writer.write(post("/generate", {"input_ids": [2], "stream": True}))
        status, _, body = await answer_of(reader)
        assert (status, body) == (200, b"data: a\n\n"), "the same connection, kept alive"
        assert len(relayed) == 2
        await setup.settled()
        assert setup.requests(200) == 2
        stats = setup.worker(decodes[0]).breaker.stats()
        assert (stats.total_successes, stats.total_failures) == (2, 0), "both streams recorded"


async def test_pipelined_requests_are_answered_in_order_on_one_connection(
    relayed: list[Relay],
) -> None:
    prefills, decodes = pair()
    async with gateway_on(prefills, decodes) as setup, connected(setup.server) as (reader, writer):
        writer.write(post("/generate", {"input_ids": [1]}) + post("/generate", {"input_ids": [2]}))
        answers = [await answer_of(reader) for _ in range(2)]
        assert [(a[0], json.loads(a[2])["ids"]) for a in answers] == [(200, [1]), (200, [2])]
        assert len(relayed) == 2
        await setup.settled()


async def test_a_prefill_503_is_retried_on_the_other_prefill(relayed: list[Relay]) -> None:
    good = asyncio.Event()
    prefills: list[Worker] = []

    async def working(worker: Worker, reader: Any, writer: asyncio.StreamWriter, _: Any) -> None:
        good.set()
        writer.write(reply(200, b"{}"))

    async def after_prefill(w: Worker, r: Any, writer: asyncio.StreamWriter, body: Any) -> None:
        await good.wait()  # a decode waits for its prefill's KV
        await decoded(w, r, writer, body)

    prefills += [Worker(first_then(503, prefills, working)) for _ in range(2)]
    decodes = [Worker(after_prefill)]
    async with gateway_on(prefills, decodes) as setup, connected(setup.server) as (reader, writer):
        writer.write(GENERATE)
        status, _, body = await answer_of(reader)
        await setup.settled()
        assert len(relayed) == 1
        assert [len(w.bodies) for w in prefills] == [1, 1], "both prefills, once each"
        failed = next(
            w for w in prefills if w.bodies[0]["bootstrap_room"] != json.loads(body)["room"]
        )
        assert status == 200
        assert retries(setup, "prefill") == 1
        assert setup.worker(failed).breaker.stats().total_failures == 1
        assert setup.failures() == 1
        assert setup.requests(200) == 1


async def test_a_prefill_400_before_the_decode_answers_is_the_answer_and_not_retried(
    relayed: list[Relay],
) -> None:
    decodes = [Worker(hang)]

    async def refusing(worker: Worker, reader: Any, writer: asyncio.StreamWriter, _: Any) -> None:
        await decodes[0].arrived.wait()  # both calls under way
        writer.write(reply(400, b'{"error": "bad prompt"}'))

    prefills = [Worker(refusing), Worker(refusing)]
    async with gateway_on(prefills, decodes) as setup, connected(setup.server) as (reader, writer):
        writer.write(GENERATE)
        status, _, body = await answer_of(reader)
        assert (status, body) == (400, b'{"error": "bad prompt"}')
        await asyncio.wait_for(decodes[0].gone.wait(), WAIT)
        await setup.settled()
        assert len(relayed) == 1
        assert sum(len(w.bodies) for w in prefills) == 1, "not retried"
        assert retries(setup, "prefill") == 0
        assert setup.requests(400) == 1


async def test_a_decode_500_is_retried_on_the_next_pair(relayed: list[Relay]) -> None:
    decodes: list[Worker] = []
    decodes += [Worker(first_then(500, decodes, decoded)) for _ in range(2)]
    prefills = [Worker(prefilled), Worker(prefilled)]
    async with gateway_on(prefills, decodes) as setup, connected(setup.server) as (reader, writer):
        writer.write(GENERATE)
        status, _, body = await answer_of(reader)
        await setup.settled()
        assert len(relayed) == 1
        assert status == 200
        (failed,) = [w for w in decodes if w.port != json.loads(body)["by"]]
        assert [len(w.bodies) for w in decodes] == [1, 1], "the other decode, once"
        assert failed.bodies[0]["bootstrap_room"] != json.loads(body)["room"], "a new pair"
        assert retries(setup, "decode") == 1
        assert setup.worker(failed).breaker.stats().total_failures == 1


async def test_a_prefill_outliving_its_answered_request_is_followed_to_its_end(
    relayed: list[Relay],
) -> None:
    release = asyncio.Event()

    async def slow(worker: Worker, reader: Any, writer: asyncio.StreamWriter, _: Any) -> None:
        await release.wait()
        writer.write(reply(200, b"{}"))

    prefills, decodes = [Worker(slow), Worker(slow)], [Worker(decoded)]
    async with gateway_on(prefills, decodes) as setup, connected(setup.server) as (reader, writer):
        writer.write(GENERATE)
        status, _, _ = await answer_of(reader)
        assert (status, len(relayed)) == (200, 1)
        await until(lambda: bool(setup.used(prefills)), "the prefill's call", WAIT)
        (prefill,) = setup.used(prefills)
        load = setup.gateway.loads.loads[setup.worker(prefill).id]
        assert load.in_flight == 1, "the prefill still runs"
        drain = asyncio.ensure_future(setup.gateway.calls.drain())
        release.set()
        await asyncio.wait_for(drain, WAIT)
        assert not prefill.gone.is_set(), "answered, not cut off"
        assert load.in_flight == 0, "drain returned once the prefill had answered"
        stats = setup.worker(prefill).breaker.stats()
        assert (stats.total_successes, stats.total_failures) == (1, 0)


async def test_a_client_leaving_before_its_answer_closes_both_calls(relayed: list[Relay]) -> None:
    prefills, decodes = [Worker(hang), Worker(hang)], [Worker(hang)]
    async with gateway_on(prefills, decodes) as setup:
        async with connected(setup.server) as (_, writer):
            writer.write(GENERATE)
            await asyncio.wait_for(decodes[0].arrived.wait(), WAIT)
            await until(lambda: bool(setup.used(prefills)), "the prefill's call")
        (prefill,) = setup.used(prefills)
        await asyncio.wait_for(asyncio.gather(prefill.gone.wait(), decodes[0].gone.wait()), WAIT)
        await until(lambda: setup.requests(499) == 1, "the request counted 499")
        await setup.settled()
        assert len(relayed) == 1
        assert setup.failures() == 0


async def test_a_client_leaving_mid_stream_closes_the_decode(relayed: list[Relay]) -> None:
    async def streaming(worker: Worker, reader: Any, writer: asyncio.StreamWriter, _: Any) -> None:
        writer.write(STREAM_HEAD + chunk(b"data: 1\n\n"))
        await until_closed(worker, reader)

    prefills, decodes = [Worker(prefilled), Worker(prefilled)], [Worker(streaming)]
    async with gateway_on(prefills, decodes) as setup:
        async with connected(setup.server) as (reader, writer):
            writer.write(post("/generate", {"input_ids": [1], "stream": True}))
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
            assert await piece_of(reader) == b"data: 1\n\n"
        await asyncio.wait_for(decodes[0].gone.wait(), WAIT)
        await until(lambda: setup.requests(200) == 1, "the stream counted by its status")
        await setup.settled()
        assert len(relayed) == 1
        assert setup.failures() == 0


def retries(setup: Setup, role: str, endpoint: str = "generate") -> float:
    labels = {"endpoint": endpoint, "role": role}
    return sample(setup.gateway, "globalkv_gateway_retries_total", **labels)


def timed_out(setup: Setup, stage: str) -> float:
    labels = {"endpoint": "generate", "stage": stage}
    return sample(setup.gateway, "globalkv_gateway_request_timeouts_total", **labels)


async def test_the_deadline_answers_504_in_the_prefill_stage(relayed: list[Relay]) -> None:
    prefills, decodes = [Worker(hang), Worker(hang)], [Worker(hang)]
    async with gateway_on(prefills, decodes) as setup, connected(setup.server) as (reader, writer):
        writer.write(GENERATE)
        await asyncio.wait_for(decodes[0].arrived.wait(), WAIT)
        await until(lambda: bool(setup.used(prefills)), "the prefill's call")
        setup.gateway.dispatcher.deadlines.expire_all()
        status, _, body = await answer_of(reader)
        assert (status, json.loads(body)["error"]["stage"]) == (504, "prefill")
        assert json.loads(body)["error"]["attempt"] == 1
        await asyncio.wait_for(decodes[0].gone.wait(), WAIT)
        await setup.settled()
        assert len(relayed) == 1
        assert timed_out(setup, "prefill") == 1
        assert setup.requests(504) == 1


async def test_the_deadline_still_answers_504_once_a_retry_took_the_request_over(
    relayed: list[Relay],
) -> None:
    decodes = [Worker(hang)]

    async def failing_then_hanging(w: Worker, reader: Any, writer: Any, body: Any) -> None:
        if sum(len(p.bodies) for p in prefills) == 1:
            await decodes[0].arrived.wait()  # both calls under way
            writer.write(reply(503, b"busy"))
        else:
            await until_closed(w, reader)

    prefills = [Worker(failing_then_hanging), Worker(failing_then_hanging)]
    async with gateway_on(prefills, decodes) as setup, connected(setup.server) as (reader, writer):
        writer.write(GENERATE)
        await until(lambda: len(decodes[0].bodies) == 2, "the retry's decode call", WAIT)
        await until(lambda: sum(len(p.bodies) for p in prefills) == 2, "the retry's prefill", WAIT)
        setup.gateway.dispatcher.deadlines.expire_all()
        status, _, body = await answer_of(reader)
        error = json.loads(body)["error"]
        assert (status, error["stage"], error["attempt"]) == (504, "prefill", 2)
        await setup.settled()
        assert len(relayed) == 1
        assert timed_out(setup, "prefill") == 1


async def test_a_streamed_decode_refusing_429_gets_openais_error_shape(
    relayed: list[Relay],
) -> None:
    refusal = {"object": "error", "message": "too busy", "type": "rate_limited", "code": 429}

    async def refusing(worker: Worker, reader: Any, writer: asyncio.StreamWriter, _: Any) -> None:
        writer.write(reply(429, json.dumps(refusal).encode()))

    prefills, decodes = [Worker(prefilled), Worker(prefilled)], [Worker(refusing)]
    request = post("/v1/completions", {"model": "m", "prompt": [1, 2, 3], "stream": True})
    retry = RetryConfig(max_retries=2, initial_backoff_ms=0)
    setup_made = gateway_on(prefills, decodes, retry=retry)
    async with setup_made as setup, connected(setup.server) as (reader, writer):
        writer.write(request)
        status, _, body = await answer_of(reader)
        await setup.settled()
        assert len(relayed) == 1
        assert len(decodes[0].bodies) == 2, "retried once, then given up"
        assert status == 429
        expected = {"message": "too busy", "type": "rate_limited", "param": None, "code": 429}
        assert json.loads(body) == {"error": expected}
        assert retries(setup, "decode", "completions") == 1
        assert setup.requests(429, "completions") == 1


async def test_no_eligible_decode_is_answered_503_by_the_relay(relayed: list[Relay]) -> None:
    prefills, decodes = pair()
    async with gateway_on(prefills, decodes) as setup, connected(setup.server) as (reader, writer):
        for worker in setup.gateway.pool:
            while worker.role == "decode" and worker.breaker.allows():
                worker.breaker.record(False)  # its circuit opens
        writer.write(GENERATE)
        status, _, body = await answer_of(reader)
        assert (status, json.loads(body)["error"]["type"]) == (503, "no_available_workers")
        assert len(relayed) == 1
        assert not decodes[0].bodies
        assert not any(w.bodies for w in prefills)
        assert setup.requests(503) == 1


async def test_http_1_0_and_an_unreadable_body_are_answered_by_the_task_path(
    relayed: list[Relay],
) -> None:
    prefills, decodes = pair()
    async with gateway_on(prefills, decodes) as setup:
        async with connected(setup.server) as (reader, writer):
            writer.write(GENERATE.replace(b"HTTP/1.1", b"HTTP/1.0", 1))
            status, headers, body = await answer_of(reader)
            assert (status, headers["connection"]) == (200, "close")
            assert json.loads(body)["ids"] == [1, 2, 3]
        async with connected(setup.server) as (reader, writer):
            writer.write(b"POST /generate HTTP/1.1\r\nhost: gw\r\ncontent-length: 5\r\n\r\nnot{}")
            status, _, body = await answer_of(reader)
            assert status == 400
            assert "error" in json.loads(body)
        await setup.settled()
        assert relayed == [], "neither is relayed"
        assert (setup.requests(200), setup.requests(400)) == (1, 1)


async def test_a_client_not_reading_its_stream_pauses_the_decode(
    relayed: list[Relay], monkeypatch: pytest.MonkeyPatch
) -> None:
    connections: list[Connection] = []
    made = Connection.connection_made

    def recorded(self: Connection, transport: asyncio.BaseTransport) -> None:
        connections.append(self)
        made(self, transport)

    monkeypatch.setattr(Connection, "connection_made", recorded)
    stop = asyncio.Event()
    sent: list[bytes] = []

    async def flooding(worker: Worker, reader: Any, writer: asyncio.StreamWriter, _: Any) -> None:
        writer.write(STREAM_HEAD)
        while not stop.is_set():  # until the test has seen the gateway hold it back
            sent.append(bytes([65 + len(sent) % 26]) * 65536)
            writer.write(chunk(sent[-1]))
            await writer.drain()
        writer.write(LAST_CHUNK)

    prefills, decodes = [Worker(prefilled), Worker(prefilled)], [Worker(flooding)]
    async with gateway_on(prefills, decodes) as setup:
        sock = socket.socket()  # a small receive buffer: the client is full sooner
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", setup.server.port))
        except OSError:
            sock.close()
            raise
        reader, writer = await asyncio.open_connection(sock=sock)
        try:
            writer.write(post("/generate", {"input_ids": [1], "stream": True}))
            port = decodes[0].port

            def decode_paused() -> bool:
                return any(c.paused and c._origin[2] == port for c in connections)

            await until(decode_paused, "reading from the decode paused", WAIT)
            stop.set()
            status, _, body = await answer_of(reader)
        finally:
            writer.close()
        assert status == 200
        assert body == b"".join(sent), "every piece, in order"
        assert len(relayed) == 1
        await setup.settled()
        assert not any(c.paused for c in connections if c._origin[2] == port)
        assert setup.requests(200) == 1


class HeldLookup(StubLookup):
    """The index answers each lookup once `release` is set; `asking` is set at the first."""

    def __init__(self, result: LookupResult) -> None:
        super().__init__(result)
        self.release = asyncio.Event()
        self.asking = asyncio.Event()
        self.cancelled = False

    async def lookup(self, model: str, token_ids: Sequence[int], *args: Any) -> LookupResult:
        self.asking.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return await super().lookup(model, token_ids, *args)


async def test_the_prefix_policy_asks_the_index_before_the_relayed_attempt(
    relayed: list[Relay],
) -> None:
    prefills, decodes = [Worker(prefilled), Worker(prefilled)], [Worker(decoded)]
    lookup = HeldLookup(LookupResult(block_size=4, blocks=1, pods=[], keys=[7]))
    async with gateway_on(prefills, decodes, lookup, prefill_policy="prefix") as setup:
        lookup.result = LookupResult(
            block_size=4,
            blocks=1,
            pods=[PodHit(setup.worker(prefills[1]).pod, 0, 1, 4, 1.0)],
            keys=[7],
        )
        async with connected(setup.server) as (reader, writer):
            writer.write(post("/generate", {"input_ids": [1, 2, 3, 4, 5]}))
            await asyncio.wait_for(lookup.asking.wait(), WAIT)
            assert [len(w.bodies) for w in prefills] == [0, 0], "routed after the index"
            lookup.release.set()
            status, _, _ = await answer_of(reader)
    assert (status, len(relayed)) == (200, 1)
    assert lookup.asked == [("m", [1, 2, 3, 4, 5])]
    assert [len(w.bodies) for w in prefills] == [0, 1], "the prefill holding the prompt"


async def test_a_client_leaving_while_the_index_is_asked_ends_the_lookup(
    relayed: list[Relay],
) -> None:
    prefills, decodes = [Worker(prefilled), Worker(prefilled)], [Worker(decoded)]
    lookup = HeldLookup(LookupResult(block_size=4, blocks=0, pods=[]))
    async with gateway_on(prefills, decodes, lookup, prefill_policy="prefix") as setup:
        async with connected(setup.server) as (_, writer):
            writer.write(GENERATE)
            await asyncio.wait_for(lookup.asking.wait(), WAIT)
        await until(lambda: lookup.cancelled, "the lookup cancelled", WAIT)
        await until(lambda: setup.requests(499) == 1, "499 counted", WAIT)
    assert len(relayed) == 1
    assert not any(w.bodies for w in (*prefills, *decodes)), "no worker called"


async def test_a_free_place_under_admission_control_is_taken_by_the_relay(
    relayed: list[Relay],
) -> None:
    release = asyncio.Event()

    async def held(worker: Worker, reader: Any, writer: asyncio.StreamWriter, body: Any) -> None:
        await release.wait()
        await decoded(worker, reader, writer, body)

    prefills, decodes = [Worker(prefilled), Worker(prefilled)], [Worker(held)]
    limit = AdmissionConfig(max_concurrent_requests=1)
    async with gateway_on(prefills, decodes, admission=limit) as setup:
        handler = setup.server.handler
        assert isinstance(handler, Inference)
        admission = handler.intake.admission
        assert admission is not None
        async with (
            connected(setup.server) as (first, one),
            connected(setup.server) as (
                second,
                two,
            ),
        ):
            one.write(GENERATE)
            await until(lambda: admission.running == 1, "the first holds the place", WAIT)
            two.write(GENERATE)
            name = "globalkv_gateway_admission_queued"
            await until(lambda: sample(setup.gateway, name) == 1, "the second queues", WAIT)
            assert len(relayed) == 1, "the queued one waits in a task"
            release.set()
            assert (await answer_of(first))[0] == 200
            assert (await answer_of(second))[0] == 200
        await until(lambda: admission.running == 0, "both places given back", WAIT)


async def test_an_unexpected_error_before_the_attempt_is_answered_500(
    relayed: list[Relay], monkeypatch: pytest.MonkeyPatch
) -> None:
    prefills, decodes = [Worker(prefilled), Worker(prefilled)], [Worker(decoded)]
    async with gateway_on(prefills, decodes) as setup:

        def broken(*_: Any) -> None:
            raise RuntimeError("a bug")

        # The rooms' generator, the one plain Python object choosing calls (the compiled
        # build's classes take no patched methods).
        monkeypatch.setattr(setup.gateway.router._rooms, "getrandbits", broken)
        async with connected(setup.server) as (reader, writer):
            writer.write(GENERATE)
            status, _, body = await answer_of(reader)
        assert (status, len(relayed)) == (500, 1)
        assert json.loads(body)["error"]["message"] == "internal error"
        assert not any(w.bodies for w in (*prefills, *decodes)), "no worker called"
