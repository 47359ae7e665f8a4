"""Envoy 1.40 as `globalkv.stack.envoy` configures it, with a real `globalkv epp`, in front
of an upstream that records what reaches it: headers only the picker may set never come
from the client, on the picked route or the failed-open one; both request body modes
route; the load a pick holds lasts as long as the response, with no response phase sent
to the picker.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.support.envoy import Envoy, Upstream, recording_upstream
from tests.support.net import free_port, wait_for
from tests.support.procs import Proc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
CHOSEN_BY_CLIENT = {
    "x-gateway-destination-endpoint": "TRAP",
    "x-gateway-destination-endpoint-subset": "TRAP",
    "x-globalkv-prefill": "10.9.9.9:1",
    "x-prefiller-host-port": "10.9.9.9:1",
}


class Trap:
    """A listener that counts the connections it receives."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self.sock.close()


@dataclass
class Stack:
    upstream: Upstream
    trap: Trap
    picker_http: str
    envoys: dict[str, Envoy]

    def send(self, envoy: str, path: str = "/generate", **headers: str) -> httpx.Response:
        chosen = {k: v.replace("TRAP", self.trap.address) for k, v in headers.items()}
        body = {"input_ids": [1, 2, 3, 4] * 8, "sampling_params": {"max_new_tokens": 2}}
        url = f"{self.envoys[envoy].url}{path}"
        return httpx.post(url, json=body, headers=chosen, timeout=30)

    def in_flight(self) -> float:
        text = httpx.get(f"{self.picker_http}/metrics", timeout=5).text
        lines = [x for x in text.splitlines() if x.startswith("globalkv_gateway_worker_in_flight")]
        return sum(float(x.rsplit(" ", 1)[1]) for x in lines)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    upstream, trap = recording_upstream(), Trap()
    grpc_port, http_port = free_port(), free_port()
    argv = ["epp", "--host", "127.0.0.1", "--port", str(http_port), "--prometheus-port", "0"]
    argv += ["--grpc-host", "127.0.0.1", "--grpc-port", str(grpc_port), "--policy", "round_robin"]
    argv += ["--worker", f"http://{upstream.address}", "--worker-startup-check-interval", "0.1"]
    picker = Proc.globalkv(*argv, name="epp-doors")
    pickers = [f"127.0.0.1:{grpc_port}"]
    nowhere = [f"127.0.0.1:{free_port()}"]  # no picker listens there: FailOpen serves
    envoys = {
        "buffered": Envoy([upstream.address], pickers, name="envoy-buffered"),
        "full-duplex": Envoy(
            [upstream.address], pickers, name="envoy-duplex", extra=["--body-mode", "full-duplex"]
        ),
        "failed-open": Envoy([upstream.address], nowhere, fail_open=True, name="envoy-open"),
    }
    built = Stack(upstream, trap, f"http://127.0.0.1:{http_port}", envoys)
    try:
        envoys["buffered"].wait_ready(pickers=1, timeout=60)
        envoys["full-duplex"].wait_ready(pickers=1, timeout=60)
        envoys["failed-open"].wait_ready(pickers=0, timeout=60)

        def serving() -> bool:
            try:
                return built.send("buffered").status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(serving, timeout=60, what="requests through Envoy and the picker")
        yield built
    finally:
        upstream.go.set()
        for envoy in envoys.values():
            envoy.proc.stop()
        picker.stop()
        upstream.stop()
        trap.close()


@pytest.mark.parametrize("envoy", ["buffered", "full-duplex", "failed-open"])
def test_headers_only_the_picker_may_set_never_come_from_the_client(
    stack: Stack, envoy: str
) -> None:
    before = len(stack.upstream.seen)
    answer = stack.send(envoy, **CHOSEN_BY_CLIENT)
    assert answer.status_code == 200, answer.text
    assert stack.trap.connections == 0
    (seen,) = stack.upstream.seen[before:]
    picked = envoy != "failed-open"
    assert seen.get("x-gateway-destination-endpoint") == (
        stack.upstream.address if picked else None
    )
    for name in CHOSEN_BY_CLIENT:
        if name != "x-gateway-destination-endpoint":
            assert name not in seen


@pytest.mark.parametrize("envoy", ["buffered", "full-duplex"])
def test_the_load_of_a_pick_lasts_as_long_as_its_response(stack: Stack, envoy: str) -> None:
    stack.upstream.go.clear()
    result: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: result.append(stack.send(envoy, "/held")))
    sender.start()
    try:
        wait_for(lambda: stack.in_flight() == 1, timeout=20, what="the pick in flight")
    finally:
        stack.upstream.go.set()
        sender.join(30)
    assert result[0].status_code == 200
    wait_for(lambda: stack.in_flight() == 0, timeout=20, what="the load released")


@pytest.mark.parametrize("envoy", ["buffered", "full-duplex"])
@pytest.mark.parametrize("size", [61_999, 250_000])
def test_bodies_route_whole_in_both_modes(stack: Stack, envoy: str, size: int) -> None:
    before = len(stack.upstream.seen)
    body = json.dumps({"input_ids": [7] * (size // 3), "sampling_params": {}}).encode()
    answer = httpx.post(f"{stack.envoys[envoy].url}/generate", content=body, timeout=30)
    assert answer.status_code == 200, answer.text
    assert int(stack.upstream.seen[before]["body-bytes"]) == len(body)
