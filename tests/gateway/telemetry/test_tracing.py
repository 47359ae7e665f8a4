"""W3C trace context through the gateway on real sockets: passed on as it came when tracing
is off; with tracing on, a span per PD stage (an in-memory exporter) whose call spans are
the `traceparent` each emulated worker receives."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.http.connections import ConnectionPool
from gateway.http.upstream import PooledUpstream
from gateway.serving.service import Gateway
from gateway.settings.config import configured_endpoint
from gateway.settings.workers import WorkerSpec
from gateway.telemetry.tracing import Tracing
from tests.gateway.fakes import Cluster, config, make_gateway
from tests.gateway.test_server import read_answer, serving

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT}-01"


@dataclass
class Worker:
    """An emulated worker: answers every POST, the first `failures` with 503."""

    failures: int = 0
    seen: list[dict[str, str]] = field(default_factory=list)
    url: str = ""
    writers: list[asyncio.StreamWriter] = field(default_factory=list)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                lines = head.decode().split("\r\n")[1:]
                headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines)}
                await reader.readexactly(int(headers.get("content-length", "0")))
                self.seen.append(headers)
                status, body = (503, b"{}") if len(self.seen) <= self.failures else (200, b"{}")
                writer.write(
                    b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (status, len(body), body)
                )
        except (asyncio.IncompleteReadError, ConnectionError):
            return


@asynccontextmanager
async def workers(*emulated: Worker) -> AsyncIterator[None]:
    servers = [await asyncio.start_server(w.serve, "127.0.0.1", 0) for w in emulated]
    for worker, server in zip(emulated, servers, strict=True):
        worker.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield
    finally:
        for server in servers:
            server.close()
        for worker in emulated:
            for writer in worker.writers:
                writer.close()
            await asyncio.gather(*(w.wait_closed() for w in worker.writers))
        for server in servers:
            await server.wait_closed()


def _request(path: str, body: dict[str, object], *headers: str) -> bytes:
    data = json.dumps(body).encode()
    head = [f"POST {path} HTTP/1.1", "host: gw", f"content-length: {len(data)}", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + data


async def _gateway(
    prefill: Worker, decode: Worker, tracing: Tracing | None
) -> tuple[Gateway, ConnectionPool]:
    cfg = config(
        prefill=[WorkerSpec(url=prefill.url, role="prefill", bootstrap_port=8998)],
        decode=[WorkerSpec(url=decode.url, role="decode")],
    )
    pool = ConnectionPool()
    gateway = await make_gateway(Cluster(), cfg, upstream=PooledUpstream(pool), tracing=tracing)
    return gateway, pool


async def _ask(port: int, request: bytes) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        status, _, _ = await read_answer(reader)
    finally:
        writer.close()
    return status


async def test_without_tracing_the_clients_trace_context_reaches_both_workers_as_is() -> None:
    prefill, decode = Worker(), Worker()
    async with workers(prefill, decode):
        gateway, pool = await _gateway(prefill, decode, None)
        async with serving(gateway) as server:
            request = _request(
                "/generate", {"input_ids": [1, 2]}, f"traceparent: {TRACEPARENT}", "tracestate: a=1"
            )
            assert await _ask(server.port, request) == 200
            assert await _ask(server.port, _request("/generate", {"input_ids": [1]})) == 200
        await gateway.calls.drain()
        await pool.aclose()
    for worker in (prefill, decode):
        first, second = worker.seen
        assert (first["traceparent"], first["tracestate"]) == (TRACEPARENT, "a=1")
        assert "traceparent" not in second, "nothing of one request's context on the next"


def _by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, list[ReadableSpan]]:
    named: dict[str, list[ReadableSpan]] = {}
    for span in spans:
        named.setdefault(span.name, []).append(span)
    return named


@pytest.mark.parametrize("stream", [False, True])
async def test_with_tracing_each_pd_stage_is_a_span_and_workers_get_their_calls_context(
    stream: bool,
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    prefill, decode = Worker(), Worker(failures=1)
    async with workers(prefill, decode):
        gateway, pool = await _gateway(prefill, decode, Tracing(provider))
        async with serving(gateway) as server:
            body = {"model": "m", "prompt": [1, 2, 3], "stream": stream}
            request = _request("/v1/completions", body, f"traceparent: {TRACEPARENT}")
            assert await _ask(server.port, request) == 200
        await gateway.calls.drain()
        await pool.aclose()
    spans = _by_name(exporter.get_finished_spans())
    (root,) = spans["POST /v1/completions"]
    assert root.parent is not None
    assert (f"{root.context.trace_id:032x}", f"{root.parent.span_id:016x}") == (TRACE_ID, PARENT)
    assert root.attributes is not None
    assert root.attributes["http.response.status_code"] == 200
    assert [(e.name, dict(e.attributes or {})) for e in root.events] == [
        ("retry", {"attempt": 1, "role": "decode", "worker": decode.url.split("//")[1]})
    ]
    assert {name: len(found) for name, found in spans.items()} == {
        "POST /v1/completions": 1,
        "route": 1,
        "prefill": 2,
        "decode": 2,
    }
    for child in (*spans["route"], *spans["prefill"], *spans["decode"]):
        assert child.parent is not None
        assert child.parent.span_id == root.context.span_id
    for role, worker in (("prefill", prefill), ("decode", decode)):
        sent = [h["traceparent"] for h in worker.seen]
        made = [f"00-{TRACE_ID}-{s.context.span_id:016x}-01" for s in spans[role]]
        assert sorted(sent) == sorted(made), role
    statuses = sorted(
        (s.attributes or {}).get("http.response.status_code") for s in spans["decode"]
    )
    assert statuses == [200, 503]
    answered = next(
        s for s in spans["decode"] if (s.attributes or {}).get("http.response.status_code") == 200
    )
    assert [e.name for e in answered.events] == (["first_byte"] if stream else [])


def test_tracing_is_on_by_the_flag_or_opentelemetrys_variables() -> None:
    assert configured_endpoint(None, {}) is None
    assert configured_endpoint("http://c:4318/v1/traces", {}) == "http://c:4318/v1/traces"
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}
    assert configured_endpoint(None, environ) == "http://c:4318"
    assert configured_endpoint(None, {}, default="http://l:4318/v1/traces") == (
        "http://l:4318/v1/traces"
    )
    assert configured_endpoint(None, environ, default="http://l:4318/v1/traces") == (
        "http://c:4318"
    )
