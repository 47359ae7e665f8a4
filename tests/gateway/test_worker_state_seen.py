"""What an operator sees of a worker going wrong: circuit transitions and the first failed
call in the log, and `/workers` never calling a worker out of traffic plainly healthy."""

from __future__ import annotations

import logging

import httpx
import orjson
import pytest

from gateway.serving.app import create_app
from gateway.serving.inference import Inference
from gateway.settings.workers import BreakerConfig, HealthConfig, RetryConfig, WorkerSpec
from gateway.workers.pool import WorkerPool
from tests.gateway.fakes import DECODES, PREFILLS, Cluster, config, make_gateway
from tests.support.clock import FakeClock


def test_every_circuit_transition_is_logged_with_the_worker_and_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock(0.0)
    breaker = BreakerConfig(failure_threshold=2, success_threshold=1, timeout_duration_secs=5)
    pool = WorkerPool(breaker, HealthConfig(), clock)
    worker = pool.add(WorkerSpec(url="http://10.0.0.9:30000", role="decode"))
    caplog.set_level(logging.INFO, logger="gateway")
    worker.breaker.record(False, "failed (ConnectError: refused)")
    assert "circuit" not in caplog.text
    worker.breaker.record(False, "failed (ConnectError: refused)")
    clock.now = 5.0
    assert worker.breaker.allows()
    worker.breaker.record(True)
    lines = [r.getMessage() for r in caplog.records if "circuit" in r.getMessage()]
    assert lines == [
        "decode 10.0.0.9:30000: circuit closed → open (2 calls in a row failed, the last: "
        "failed (ConnectError: refused))",
        "decode 10.0.0.9:30000: circuit open → half_open (open for 5 s)",
        "decode 10.0.0.9:30000: circuit half_open → closed (1 calls in a row succeeded)",
    ]
    assert [r.levelname for r in caplog.records if "circuit" in r.getMessage()] == [
        "WARNING",
        "INFO",
        "INFO",
    ]


async def test_workers_shows_an_open_circuit_beside_a_passing_health_check() -> None:
    gateway = await make_gateway(Cluster(), config())
    decode = gateway.find(DECODES[0])
    assert decode is not None
    for _ in range(10):
        decode.breaker.record(False, "answered HTTP 500")
    transport = httpx.ASGITransport(app=create_app(gateway, run_monitor=False))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        shown = (await client.get(f"/workers/{decode.id}")).json()
        other = (await client.get(f"/workers/{PREFILLS[0].split('//')[1]}")).json()
    assert shown["status"] == "no traffic: circuit open for 60 s more"
    assert (shown["eligible"], shown["health"], shown["circuit"]) == (False, "healthy", "open")
    assert shown["circuit_retry_in_secs"] == 60.0
    assert (other["status"], other["circuit_retry_in_secs"]) == ("serving", None)


async def test_the_first_failed_call_to_a_dead_prefill_is_logged_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cluster = Cluster()
    cfg = config(
        prefill=[WorkerSpec(url=PREFILLS[0], role="prefill", bootstrap_port=8998)],
        retry=RetryConfig(disabled=True),
    )
    gateway = await make_gateway(cluster, cfg)
    cluster.down.add(PREFILLS[0].split("//")[1])
    caplog.set_level(logging.INFO, logger="gateway")
    body = orjson.dumps({"input_ids": [1, 2, 3]})
    for _ in range(2):
        await Inference(gateway).handle("/generate", None, body)
        await gateway.calls.drain()
    failures = [r for r in caplog.records if "a call failed" in r.getMessage()]
    assert [r.getMessage() for r in failures] == [
        "prefill 10.0.0.1:30001: a call failed (ConnectError: connection refused)"
    ]
    assert failures[0].levelname == "WARNING"
    cluster.down.clear()
    await Inference(gateway).handle("/generate", None, body)
    await gateway.calls.drain()
    assert "prefill 10.0.0.1:30001 answers again after 2 failed calls" in caplog.text
