"""Fake workers behind httpx.MockTransport, a fake clock and a stub directory reader."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from random import Random
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from gateway.http.answer import Answer
from gateway.http.upstream import Upstream
from gateway.requests.bodies import ParsedRequest
from gateway.requests.query import RouteQuery
from gateway.requests.request import Request
from gateway.serving.reading import INFERENCE_PATHS
from gateway.serving.service import Gateway, build_gateway
from gateway.settings.config import GatewayConfig
from gateway.settings.workers import HealthConfig, KvEventsSpec, WorkerSpec
from gateway.telemetry.tracing import Tracing
from gateway.workers.monitor import PodRegistration
from globalkv.index.base import IndexUnavailable
from globalkv.lookup import LookupResult
from globalkv.tokenize import Tokenizer
from tests.support.clock import FakeClock, RecordedSleep
from tests.support.metrics import sample as registry_sample

Behaviour = Callable[[httpx.Request, Any], Awaitable[httpx.Response]]

PREFILLS = ("http://10.0.0.1:30001", "http://10.0.0.2:30001")
DECODES = ("http://10.0.1.1:30011", "http://10.0.1.2:30011")
POD = PodRegistration(
    id="pod-a",
    model="m",
    block_size=16,
    role="prefill",
    url=PREFILLS[0],
    bootstrap_host="10.0.0.1",
    bootstrap_port=8998,
    kv_events=KvEventsSpec(endpoint="tcp://10.0.0.1:5557", topic="kv@pod-a@m"),
    dp_size=2,
)
"""A prefill pod as the monitor registers it."""


@dataclass
class Call:
    worker: str
    method: str
    path: str
    body: Any
    cancelled: bool = False
    started: asyncio.Event = field(default_factory=asyncio.Event)


async def ok_json(_: httpx.Request, body: Any) -> httpx.Response:
    return httpx.Response(200, json={"text": "ok", "room": body.get("bootstrap_room")})


class Cluster:
    """Every fake worker, answering by host:port; records each call."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.behaviour: dict[str, Behaviour] = {}
        self.health: dict[str, int] = {}
        self.down: set[str] = set()
        """host:port of workers whose every call fails to connect."""
        self.server_info: dict[str, Any] = {}
        """host:port → its /server_info JSON, or an int: the status it answers instead."""
        self.metrics: dict[str, str] = {}
        """host:port → the text its /metrics answers."""
        self.event_sources: dict[str, Any] = {}
        """host:port → its /kv_event_sources JSON (vLLM's), or an int: the status it answers."""
        self.models: dict[str, Any] = {}
        """host:port → its /v1/models JSON."""
        self._arrived = asyncio.Condition()

    async def wait_calls(self, count: int) -> list[Call]:
        """Until `count` inference calls have started."""
        async with self._arrived:
            await self._arrived.wait_for(lambda: len(self.inference()) >= count)
        return self.inference()

    def on(self, url: str, behaviour: Behaviour) -> None:
        self.behaviour[url.split("//", 1)[1]] = behaviour

    def hold_decodes(self, release: asyncio.Event) -> None:
        """The decodes answer (with the room they got) once `release` is set."""

        async def held(_: httpx.Request, body: Any) -> httpx.Response:
            await release.wait()
            return httpx.Response(200, json={"room": body["bootstrap_room"]})

        for url in DECODES:
            self.on(url, held)

    def one_prefill_fails(self, broken: str, good: str) -> None:
        """`broken` answers 500; the decodes answer (with their room) only once `good`
        has answered, so a pair with the broken prefill is retried while its decode waits."""
        prefilled = asyncio.Event()

        async def failing(_: httpx.Request, __: Any) -> httpx.Response:
            return httpx.Response(500, json={"error": "kv pool exhausted"})

        async def working(_: httpx.Request, __: Any) -> httpx.Response:
            prefilled.set()
            return httpx.Response(200, json={})

        async def waiting(_: httpx.Request, body: Any) -> httpx.Response:
            await prefilled.wait()
            return httpx.Response(200, json={"room": body["bootstrap_room"]})

        self.on(broken, failing)
        self.on(good, working)
        for url in DECODES:
            self.on(url, waiting)

    def hang_every_worker(self) -> None:
        """Every worker takes calls and never answers: only a cancellation ends them."""

        async def hanging(_: httpx.Request, __: Any) -> httpx.Response:
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

        for url in (*PREFILLS, *DECODES):
            self.on(url, hanging)

    def inference(self, role: str | None = None) -> list[Call]:
        calls = [c for c in self.calls if c.method == "POST"]
        if role is None:
            return calls
        hosts = {u.split("//", 1)[1] for u in (PREFILLS if role == "prefill" else DECODES)}
        return [c for c in calls if c.worker in hosts]

    async def handler(self, request: httpx.Request) -> httpx.Response:
        key = f"{request.url.host}:{request.url.port}"
        if key in self.down:
            raise httpx.ConnectError("connection refused")
        if request.method == "GET":
            if request.url.path == "/health":
                return httpx.Response(self.health.get(key, 200), text="OK")
            if request.url.path == "/server_info" and key in self.server_info:
                info = self.server_info[key]
                if isinstance(info, int):
                    return httpx.Response(info, text="not now")
                return httpx.Response(200, json=info)
            if request.url.path == "/kv_event_sources" and key in self.event_sources:
                sources = self.event_sources[key]
                if isinstance(sources, int):
                    return httpx.Response(sources, text="not now")
                return httpx.Response(200, json=sources)
            if request.url.path == "/metrics" and key in self.metrics:
                return httpx.Response(200, text=self.metrics[key])
            if request.url.path == "/v1/models" and key in self.models:
                return httpx.Response(200, json=self.models[key])
            return httpx.Response(404, json={"detail": "Not Found"})
        body = json.loads(request.content) if request.content else None
        call = Call(key, request.method, request.url.path, body)
        self.calls.append(call)
        call.started.set()
        async with self._arrived:
            self._arrived.notify_all()
        try:
            return await self.behaviour.get(key, ok_json)(request, body)
        except asyncio.CancelledError:
            call.cancelled = True
            raise


@dataclass(frozen=True)
class Reading:
    reachable: bool = True
    ready: bool = True
    topology: dict[str, Any] | None = None
    registered: int = 1
    expected: int | None = 1
    error: str | None = None


class StubProbe:
    def __init__(self) -> None:
        self.readings: dict[str, Reading] = {}
        self.reads: list[str] = []

    async def read(self, bootstrap_url: str) -> Reading:
        self.reads.append(bootstrap_url)
        return self.readings.get(bootstrap_url, Reading(topology={"dp_size": 1}))


class StubLookup:
    def __init__(self, result: LookupResult | None = None, *, down: bool = False) -> None:
        self.result = result or LookupResult(block_size=4, blocks=0, pods=[])
        self.down = down
        self.asked: list[tuple[str, list[int]]] = []
        self.namespaces: list[tuple[str | None, str | None]] = []
        """(LoRA name, cache salt) of each lookup."""

    async def lookup(
        self,
        model: str,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> LookupResult:
        self.asked.append((model, list(token_ids)))
        self.namespaces.append((lora_name, cache_salt))
        if self.down:
            raise IndexUnavailable("stub index is down")
        return self.result


def config(**overrides: Any) -> GatewayConfig:
    base: dict[str, Any] = {
        "prefill": [
            WorkerSpec(url=PREFILLS[0], role="prefill", bootstrap_port=8998),
            WorkerSpec(url=PREFILLS[1], role="prefill", bootstrap_port=8999),
        ],
        "decode": [WorkerSpec(url=u, role="decode") for u in DECODES],
        "health": HealthConfig(),
        "model": "m",
        "prometheus_port": None,
        "seed": 7,
    }
    base.update(overrides)
    return GatewayConfig(**base)


async def make_gateway(
    cluster: Cluster,
    cfg: GatewayConfig | None = None,
    *,
    lookup: StubLookup | None = None,
    probe: StubProbe | None = None,
    tokenizer: Tokenizer | None = None,
    registrar: Any = None,
    clock: FakeClock | None = None,
    sleeps: RecordedSleep | None = None,
    upstream: Upstream | None = None,
    tracing: Tracing | None = None,
) -> Gateway:
    """A gateway over the fake cluster, its monitor run once so workers are eligible.

    Inference goes through `upstream` when given (real sockets), else the fake cluster.
    """
    client = httpx.AsyncClient(transport=httpx.MockTransport(cluster.handler))
    gateway = build_gateway(
        cfg or config(),
        client,
        upstream=upstream,
        lookup=lookup,
        registrar=registrar,
        probe=probe or StubProbe(),
        tokenizer=tokenizer,
        registry=CollectorRegistry(),
        clock=clock or FakeClock(),
        sleep=sleeps or RecordedSleep(),
        rng=Random(7),
        room_rng=Random(11),
        tracing=tracing,
    )
    await gateway.monitor.run_once(force=True)
    return gateway


async def rest_of(answer: Answer) -> bytes:
    """The pieces of a streamed answer after its first, read to its end."""
    assert answer.rest is not None
    pieces = []
    while piece := await answer.rest.next():
        pieces.append(piece)
    return b"".join(pieces)


def sample(gateway: Gateway, name: str, **labels: str) -> float:
    return registry_sample(gateway.metrics.registry, name, **labels)


def request_of(parsed: ParsedRequest, query: RouteQuery | None = None) -> Request:
    """`parsed` as the reader makes it into a `Request`, for tests that call the dispatcher
    or the legs directly: at its endpoint's path, choosing reading `query` (else
    `query_of`), without a request id."""
    path = next(path for path, endpoint in INFERENCE_PATHS.items() if endpoint == parsed.endpoint)
    return Request(path, parsed, query_of(parsed) if query is None else query)


def query_of(parsed: ParsedRequest) -> RouteQuery:
    """What choosing reads of `parsed`, as the handler reads it, for tests that call the
    dispatcher or the router directly (its tokens as given, the base namespace, no lookup
    yet)."""
    kind = "sglang" if parsed.endpoint == "generate" else None
    return RouteQuery(parsed.token_ids, parsed.text, kind=kind, batch=parsed.batch)
