"""Envoy 1.40 with `globalkv epp` in front of an aggregated SGLang pool, every process real.

Two emulated engines serve whole requests; two picker replicas share one Redis (the index
the indexer writes, and the in-flight load they share); one Envoy fails closed, another
open, both with both pickers as their ext_proc cluster. The tests that kill pickers run
last, in order: one replica, then both.
"""

from __future__ import annotations

import json
import signal
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.support.envoy import Envoy
from tests.support.net import free_port, wait_for
from tests.support.procs import Proc
from tests.support.redis import RedisServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
MODEL = "envoy-model"
PAGE = 16


@dataclass
class Pool:
    engines: dict[str, str]
    """Pod id → URL."""
    pickers: list[Proc]
    closed: Envoy
    opened: Envoy
    redis_url: str
    picker_argv: list[list[str]]
    spawn: Callable[..., Proc]

    def restart_picker(self, i: int) -> Proc:
        """Picker `i` again, on the same ports: stopped first if it still runs (a test run
        alone finds it running; run in order, the one before stopped it)."""
        self.pickers[i].stop()
        self.pickers[i] = self.spawn(*self.picker_argv[i], name=f"epp-{i}-again")
        return self.pickers[i]

    def completion(self, envoy: Envoy, prompt: str, **fields: Any) -> httpx.Response:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, **fields}
        return httpx.post(f"{envoy.url}/v1/completions", json=body, timeout=30)


@pytest.fixture(scope="module")
def pool(redis_server: RedisServer) -> Iterator[Pool]:
    procs: list[Proc] = []

    def spawn(*argv: str, name: str) -> Proc:
        proc = Proc.globalkv(*argv, name=name)
        procs.append(proc)
        return proc

    envoys: list[Envoy] = []
    try:
        import redis

        with redis.Redis(port=redis_server.port) as client:
            client.flushall()
        url = redis_server.url
        indexer_port = free_port()
        spawn(
            *("indexer", "--host", "127.0.0.1", "--port", str(indexer_port)),
            *("--redis-url", url, "--block-size", str(PAGE)),
            name="indexer",
        )
        engines: dict[str, str] = {}
        for pod in ("w0", "w1"):
            port = free_port()
            spawn(
                *("engine", "--role", "prefill", "--port", str(port), "--model", MODEL),
                *("--page-size", str(PAGE), "--pod-id", pod, "--bootstrap-port", "0"),
                *("--kv-events-endpoint", "tcp://*:0", "--kv-events-replay-endpoint", "tcp://*:0"),
                *("--prefill-tokens-per-s", "500000", "--decode-tokens-per-s", "400"),
                name=pod,
            )
            engines[pod] = f"http://127.0.0.1:{port}"
        grpc_ports = [free_port(), free_port()]
        pickers, picker_argv = [], []
        for i, grpc_port in enumerate(grpc_ports):
            argv = ["epp", "--host", "127.0.0.1", "--port", str(free_port())]
            argv += ["--prometheus-port", "0", "--grpc-host", "127.0.0.1"]
            argv += ["--grpc-port", str(grpc_port), "--redis-url", url, "--block-size", str(PAGE)]
            argv += ["--share-state-interval-secs", "0.2", "--model", MODEL, "--tokenizer", "byte"]
            argv += ["--worker-startup-check-interval", "0.1", "--directory-refresh-secs", "0.1"]
            for engine in engines.values():
                argv += ["--worker", engine]
            picker_argv.append(argv)
            pickers.append(spawn(*argv, name=f"epp-{i}"))
        endpoints = [u.split("//", 1)[1] for u in engines.values()]
        addresses = [f"127.0.0.1:{p}" for p in grpc_ports]
        closed = Envoy(endpoints, addresses, name="envoy-closed")
        opened = Envoy(endpoints, addresses, fail_open=True, name="envoy-open")
        envoys += [closed, opened]
        for envoy in envoys:
            envoy.wait_ready(pickers=2, timeout=60)
        built = Pool(engines, pickers, closed, opened, url, picker_argv, spawn)
        wait_for(lambda: _ready(built), timeout=60, what="requests through Envoy")
        yield built
    finally:
        for envoy in envoys:
            envoy.proc.stop()
        for proc in reversed(procs):
            proc.stop()


def _ready(pool: Pool) -> bool:
    try:
        return pool.completion(pool.closed, "ready?").status_code == 200
    except httpx.HTTPError:
        return False


def _cached(answer: httpx.Response) -> int:
    assert answer.status_code == 200, answer.text
    return int(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_a_repeated_prefix_lands_on_the_pod_that_holds_it(pool: Pool) -> None:
    prefix = f"{uuid.uuid4().hex} a long shared system prompt for every turn " * 4
    assert _cached(pool.completion(pool.closed, prefix + "first")) == 0

    def indexed() -> bool:  # the KV events reached the index both pickers read
        return _cached(pool.completion(pool.closed, prefix + "probe")) >= len(prefix) // 2

    wait_for(indexed, timeout=20, what="the prefix in the index")
    for turn in range(6):  # by chance, both pods would each take some of them
        assert _cached(pool.completion(pool.closed, f"{prefix}turn {turn}")) >= len(prefix) // 2


def test_whole_and_streamed_answers_pass_intact(pool: Pool) -> None:
    whole = pool.completion(pool.closed, "hello there", max_tokens=8)
    assert whole.status_code == 200
    assert whole.json()["usage"]["completion_tokens"] == 8
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    with httpx.stream(
        "POST", f"{pool.closed.url}/v1/chat/completions", json={**body, "stream": True}, timeout=30
    ) as stream:
        assert stream.status_code == 200
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")) == 8


@pytest.mark.parametrize("size", [61_999, 62_001, 250_000])
def test_bodies_over_envoys_piece_size_arrive_whole(pool: Pool, size: int) -> None:
    prompt = "y" * size
    answer = pool.completion(pool.closed, prompt, max_tokens=1)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] == size + 1  # BOS + one byte per token


def test_a_body_that_is_no_request_is_answered_400_by_the_picker(pool: Pool) -> None:
    answer = httpx.post(f"{pool.closed.url}/v1/completions", content=b"{broken", timeout=10)
    assert answer.status_code == 400
    assert answer.json()["error"]["type"] == "invalid_request_error"


def _under_load(
    pool: Pool, stop: Callable[[threading.Event], None], total: int = 120
) -> dict[str, list[int]]:
    """Statuses of `total` requests sent 4 at a time, `stop` called once 20 have been
    answered; `stop` sets the event it is given once the picker stopped. Grouped by when
    each ran: answered before, in flight when the picker stopped, or sent after."""
    done = threading.Semaphore(0)
    stopping, stopped = threading.Event(), threading.Event()
    phases: dict[str, list[int]] = {"before": [], "in flight": [], "after": []}

    def one(i: int) -> None:
        sent_after = stopped.is_set()
        try:
            status = pool.completion(pool.closed, f"load {i}", max_tokens=2).status_code
        except httpx.HTTPError:
            status = 0
        phase = "after" if sent_after else "in flight" if stopping.is_set() else "before"
        phases[phase].append(status)
        done.release()

    with ThreadPoolExecutor(4) as executor:
        futures = [executor.submit(one, i) for i in range(total)]
        for _ in range(20):
            assert done.acquire(timeout=30)
        stopping.set()
        stop(stopped)
        for future in futures:
            future.result(timeout=60)
    return phases


def test_a_picker_stopped_by_sigterm_fails_no_request(pool: Pool) -> None:
    picker = pool.pickers[0]

    def terminate(stopped: threading.Event) -> None:
        picker.signal(signal.SIGTERM)
        stopped.set()

    phases = _under_load(pool, terminate)
    statuses = phases["before"] + phases["in flight"] + phases["after"]
    assert statuses == [200] * 120
    assert picker.popen.wait(30) == 0


def test_a_picker_killed_fails_only_the_requests_in_flight_on_it(pool: Pool) -> None:
    picker = pool.pickers[1]
    replacement = pool.restart_picker(0)
    pool.closed.wait_ready(pickers=2)

    def kill(stopped: threading.Event) -> None:
        picker.signal(signal.SIGKILL)
        stopped.set()
        # Requests go on being sent while Envoy still counts it among the pickers: their
        # streams that find it gone are retried on the other.
        pool.closed.wait_ready(pickers=1)

    phases = _under_load(pool, kill)
    assert len(phases["before"]) >= 20
    assert phases["before"] == [200] * len(phases["before"])
    assert len(phases["in flight"]) <= 4
    assert phases["after"] == [200] * len(phases["after"])
    assert len(phases["after"]) >= 90
    assert replacement.alive()


def test_with_every_picker_down_fail_open_serves_and_fail_close_answers_503(pool: Pool) -> None:
    for picker in pool.pickers:
        if picker.alive():
            picker.kill()
    # A request whose body was already streamed to a picker as it died fails either way
    # (Envoy no longer holds that body); once health checks took the pickers out, FailOpen
    # sends every request to the fallback cluster.
    for envoy in (pool.opened, pool.closed):
        envoy.wait_ready(pickers=0)
    for turn in range(3):
        assert pool.completion(pool.opened, f"still served {turn}").status_code == 200
        assert pool.completion(pool.closed, f"refused {turn}").status_code == 503
