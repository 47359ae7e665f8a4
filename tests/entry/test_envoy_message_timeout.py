"""A request held in the picker's flow queues longer than Envoy's ext_proc message timeout
is still served: the picker asks Envoy for the time the wait may take as the request
starts waiting (`override_message_timeout`, up to the `max_message_timeout` that
`globalkv envoy` renders), so Envoy 1.40 does not give up on it after its own timeout."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.support.envoy import Envoy, Upstream, recording_upstream
from tests.support.net import free_port, wait_for
from tests.support.procs import Proc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
MESSAGE_TIMEOUT = 1.0


@dataclass
class Stack:
    upstream: Upstream
    envoy: Envoy
    picker_http: str

    def send(self, held: bool = False) -> httpx.Response:
        """A request to `/generate`; `held`: the upstream holds it until told to answer."""
        body = {"input_ids": [1, 2, 3, 4] * 8, "sampling_params": {"max_new_tokens": 2}}
        headers = {"x-held": "1"} if held else {}
        return httpx.post(f"{self.envoy.url}/generate", json=body, headers=headers, timeout=30)

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.picker_http}/metrics", timeout=5).text
        lines = [x for x in text.splitlines() if x.partition("{")[0].partition(" ")[0] == name]
        return sum(float(x.rsplit(" ", 1)[1]) for x in lines)

    def envoy_stat(self, suffix: str) -> int:
        text = httpx.get(f"{self.envoy.admin}/stats", timeout=5).text
        found = [x for x in text.splitlines() if x.split(":")[0].endswith(suffix)]
        return sum(int(x.rsplit(" ", 1)[1]) for x in found)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    upstream = recording_upstream()
    grpc_port, http_port = free_port(), free_port()
    argv = ["epp", "--host", "127.0.0.1", "--port", str(http_port), "--prometheus-port", "0"]
    argv += ["--grpc-host", "127.0.0.1", "--grpc-port", str(grpc_port), "--policy", "round_robin"]
    argv += ["--worker", f"http://{upstream.address}", "--worker-startup-check-interval", "0.1"]
    argv += ["--flow-control", "--max-concurrent-requests", "1", "--queue-timeout-secs", "20"]
    picker = Proc.globalkv(*argv, name="epp-flow")
    pickers = [f"127.0.0.1:{grpc_port}"]
    timeout = ["--message-timeout-secs", str(MESSAGE_TIMEOUT)]
    envoy = Envoy([upstream.address], pickers, name="envoy-flow", extra=timeout)
    built = Stack(upstream, envoy, f"http://127.0.0.1:{http_port}")
    try:
        envoy.wait_ready(pickers=1, timeout=60)
        upstream.go.set()

        def serving() -> bool:
            try:
                return built.send().status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(serving, timeout=60, what="requests through Envoy and the picker")
        yield built
    finally:
        envoy.proc.stop()
        picker.stop()
        upstream.stop()


def test_a_request_waiting_its_turn_longer_than_the_message_timeout_is_served(
    stack: Stack,
) -> None:
    stack.upstream.go.clear()
    answers: dict[str, httpx.Response] = {}

    def send(name: str, held: bool) -> threading.Thread:
        thread = threading.Thread(target=lambda: answers.__setitem__(name, stack.send(held)))
        thread.start()
        return thread

    first = send("first", held=True)
    try:
        wait_for(
            lambda: stack.metric("globalkv_gateway_flow_running") == 1,
            timeout=20,
            what="the first request holding the one place",
        )
        asked_before = stack.envoy_stat("override_message_timeout_received")
        sent = time.monotonic()
        second = send("second", held=False)
        wait_for(
            lambda: stack.metric("globalkv_gateway_flow_queued") == 1,
            timeout=20,
            what="the second request waiting its turn",
        )
        wait_for(
            lambda: "second" in answers or time.monotonic() - sent > 3 * MESSAGE_TIMEOUT,
            timeout=20,
            what="three message timeouts of waiting",
        )
        assert "second" not in answers, f"answered while waiting: {answers['second'].text}"
        assert stack.envoy_stat("override_message_timeout_received") == asked_before + 1
    finally:
        stack.upstream.go.set()
        first.join(30)
    second.join(30)
    assert answers["first"].status_code == 200, answers["first"].text
    assert answers["second"].status_code == 200, answers["second"].text
    assert stack.metric("globalkv_gateway_flow_queued") == 0
