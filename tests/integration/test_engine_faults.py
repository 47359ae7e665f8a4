"""Every stage of a disaggregated request can fail, and the failure names its stage."""

from __future__ import annotations

import json
import signal
import socket
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.enginesim.cluster import EngineProc, engines, pd_body, pd_request, start_engine
from tests.support.net import free_port, wait_for
from tests.support.procs import Proc

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def decode() -> Iterator[EngineProc]:
    with engines(
        (
            "decode",
            [
                "--bootstrap-retry-interval",
                "0.05",
                "--bootstrap-max-tries",
                "3",
                "--connect-timeout",
                "2",
                "--transfer-timeout",
                "5",
            ],
        )
    ) as (engine,):
        yield engine


def error_of(response: httpx.Response) -> dict[str, str]:
    error: dict[str, str] = response.json()["error"]
    return error


@pytest.mark.parametrize(
    ("fault", "reason", "text"),
    [
        ("--fault-wrong-room-rate", "mismatch", "bootstrap_room mismatch"),
        ("--fault-unready-room-rate", "not_ready", "not ready (bootstrap_room=0)"),
    ],
)
async def test_decode_catches_a_bad_room_in_the_kv_metadata(
    decode: EngineProc, fault: str, reason: str, text: str
) -> None:
    with engines(("prefill", [fault, "1"])) as (prefill,):
        before = decode.metric("globalkv_engine_room_check_failures_total", {"reason": reason})
        body = pd_body(prefill, 4242, text="a prompt", sampling_params={"max_new_tokens": 2})
        prefill_answer, decode_answer = await pd_request(prefill, decode, "/generate", body)
    assert prefill_answer.status_code == 200
    assert decode_answer.status_code == 500
    error = error_of(decode_answer)
    assert error["stage"] == "room"
    assert text in error["message"]
    assert "bootstrap_room=4242" in error["message"]
    after = decode.metric("globalkv_engine_room_check_failures_total", {"reason": reason})
    assert after == before + 1
    assert decode.metric("globalkv_engine_request_failures_total", {"stage": "room"}) >= 1


def test_incomplete_directory_fails_the_decode_at_the_register_stage(
    decode: EngineProc,
) -> None:
    port = free_port()
    directory = Proc.globalkv("bootstrap", "--host", "127.0.0.1", "--port", str(port), name="dir")
    try:
        directory.wait_http(f"http://127.0.0.1:{port}/health")
        only_rank_0_of_2 = {
            "attn_tp_size": 2, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0,
            "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
            "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": "127.0.0.1",
            "rank_port": free_port(), "page_size": 16, "kv_cache_dtype": "auto",
        }  # fmt: skip
        put = httpx.put(f"http://127.0.0.1:{port}/route", json=only_rank_0_of_2)
        assert put.status_code == 200
        body = {
            "text": "hi",
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": port,
            "bootstrap_room": 7,
        }
        answer = httpx.post(f"{decode.url}/generate", json=body, timeout=30)
    finally:
        directory.stop()
    assert answer.status_code == 500
    error = error_of(answer)
    assert error["stage"] == "register"
    assert f"127.0.0.1:{port}" in error["message"]
    assert "not fully registered yet (1 workers registered)" in error["message"], error


async def test_failed_prefill_fails_its_decode_at_once_with_the_reason(decode: EngineProc) -> None:
    with engines(("prefill", ["--fault-fail-rate", "1"])) as (prefill,):
        body = pd_body(prefill, 5151, text="doomed", sampling_params={"max_new_tokens": 2})
        prefill_answer, decode_answer = await pd_request(prefill, decode, "/generate", body)
        assert (
            prefill.metric("globalkv_engine_faults_injected_total", {"kind": "fail_request"}) == 1
        )
    assert prefill_answer.status_code == 500
    assert error_of(prefill_answer)["stage"] == "fault"
    assert decode_answer.status_code == 500
    error = error_of(decode_answer)
    assert error["stage"] in {"connect", "transfer"}
    assert "injected failure" in error["message"]


def test_prefill_without_a_decode_fails_at_the_handshake_stage() -> None:
    prefill = start_engine("prefill", "--handshake-timeout", "0.3")
    try:
        body = pd_body(prefill, 99, text="alone")
        answer = httpx.post(f"{prefill.url}/generate", json=body, timeout=10)
        failures = prefill.metric("globalkv_engine_request_failures_total", {"stage": "handshake"})
    finally:
        prefill.stop()
    assert failures == 1
    assert answer.status_code == 500
    error = error_of(answer)
    assert error["stage"] == "handshake"
    assert "no decode handshake for bootstrap_room 99" in error["message"]


async def test_dead_prefill_ranks_fail_the_connect_stage(decode: EngineProc) -> None:
    prefill = start_engine("prefill", "--keepalive-interval", "60")
    body = pd_body(prefill, 31337, text="warm the resolver cache")
    _, decode_ok = await pd_request(prefill, decode, "/generate", body)
    assert decode_ok.status_code == 200
    prefill.proc.kill()
    async with httpx.AsyncClient(timeout=30) as client:
        answer = await client.post(f"{decode.url}/generate", json={**body, "bootstrap_room": 31338})
    prefill.stop()
    assert answer.status_code == 500
    error = error_of(answer)
    assert error["stage"] == "connect"
    assert "no answer for bootstrap_room 31338" in error["message"]


def running(engine: EngineProc, count: int) -> Callable[[], bool]:
    return lambda: engine.metric("globalkv_engine_running_requests") == count


def test_a_client_leaving_ends_the_prefills_wait_and_a_late_decode_learns_why(
    decode: EngineProc,
) -> None:
    prefill = start_engine("prefill", "--handshake-timeout", "600")
    try:
        body = json.dumps(pd_body(prefill, 4711, text="abandoned")).encode()
        head = "POST /generate HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\n"
        head += f"Content-Length: {len(body)}\r\n\r\n"
        port = int(prefill.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            client.sendall(head.encode() + body)
            wait_for(running(prefill, 1), timeout=10, what="the prefill to wait for its decode")
        cancelled = {"endpoint": "/generate", "outcome": "cancelled"}
        wait_for(
            lambda: prefill.metric("globalkv_engine_requests_total", cancelled) == 1,
            timeout=10,
            what="the prefill to cancel the abandoned request",
        )
        assert running(prefill, 0)()
        late = httpx.post(
            f"{decode.url}/generate", json=pd_body(prefill, 4711, text="x"), timeout=30
        )
    finally:
        prefill.stop()
    assert late.status_code == 500
    error = error_of(late)
    assert error["stage"] == "connect"
    assert "prefill request cancelled" in error["message"]


def test_shutdown_answers_a_prefill_waiting_for_its_decode_at_once() -> None:
    prefill = start_engine("prefill", "--handshake-timeout", "600")
    body = pd_body(prefill, 4712, text="interrupted")
    with ThreadPoolExecutor(1) as pool:
        try:
            answer = pool.submit(httpx.post, f"{prefill.url}/generate", json=body, timeout=30)
            wait_for(running(prefill, 1), timeout=10, what="the prefill to wait for its decode")
            prefill.proc.signal(signal.SIGTERM)
            response = answer.result(timeout=30)
        finally:
            code = prefill.proc.stop()
    assert response.status_code == 503
    error = error_of(response)
    assert error["stage"] == "handshake"
    assert "the prefill is shutting down" in error["message"]
    assert code == 0
    assert "graceful shutdown exceeded" not in prefill.proc.log()


def test_a_taken_port_stops_the_engine_with_a_clear_error() -> None:
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        clash = Proc.globalkv("engine", "--role", "decode", "--port", str(port), name="clash")
        try:
            assert clash.popen.wait(30) == 1
        finally:
            clash.stop()
    assert "engine could not start" in clash.log()
    assert "Address already in use" in clash.log()
