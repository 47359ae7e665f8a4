"""Protected mode against a client that really is on another host: a network namespace.

The namespace is joined to this one by a veth pair with addresses of its own
(10.213.N.1 here, 10.213.N.2 there, a /30); each service runs as a real `globalkv`
process bound to this side's address, and the client runs inside the namespace
(`ip netns exec`), so every request arrives from 10.213.N.2 as it would from another
machine. Skipped, with the reason, where namespaces cannot be made (not root, no `ip`, no
CAP_SYS_ADMIN); the namespace and the veth pair are removed whatever happens.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import msgpack
import pytest

from tests.bootstrap.factories import body
from tests.support.metrics import scrape
from tests.support.net import wait_for
from tests.support.procs import Proc

pytestmark = pytest.mark.integration

_COMMAND_TIMEOUT = 10.0
_CLIENT = """
import json, sys
import httpx
answers = []
with httpx.Client(timeout=5.0) as client:
    for method, url, headers, payload in json.loads(sys.argv[1]):
        response = client.request(method, url, headers=headers, json=payload)
        answers.append([response.status_code, response.text])
print(json.dumps(answers))
"""
"""Sends each request given as JSON and prints every (status, text): one process per batch."""


@dataclass(frozen=True)
class Namespace:
    name: str
    host_address: str
    """This side of the veth pair, where the services listen."""
    client_address: str
    """The namespace's side, where every request comes from."""

    def free_port(self) -> int:
        with socket.socket() as sock:
            sock.bind((self.host_address, 0))
            return int(sock.getsockname()[1])

    def requests(self, *batch: tuple[str, str, dict[str, str], Any]) -> list[tuple[int, str]]:
        """Each (method, url, headers, json body) sent from inside the namespace, in order."""
        argv = ["ip", "netns", "exec", self.name, sys.executable, "-c", _CLIENT]
        done = subprocess.run(
            [*argv, json.dumps(batch)], capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == 0, done.stderr
        return [(status, text) for status, text in json.loads(done.stdout)]

    def request(
        self, method: str, url: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, str]:
        (answer,) = self.requests((method, url, headers or {}, body))
        return answer


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=_COMMAND_TIMEOUT, check=False
    )


@pytest.fixture(scope="module")
def netns() -> Iterator[Namespace]:
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("network namespaces need Linux and root")
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2) to make a network namespace")
    tag = os.getpid()
    subnet = f"10.213.{tag % 250}"
    namespace = Namespace(f"gkv-doors-{tag}", f"{subnet}.1", f"{subnet}.2")
    host_link, peer_link = f"gkv{tag}h", f"gkv{tag}p"
    created = _ip("netns", "add", namespace.name)
    if created.returncode != 0:
        pytest.skip(f"cannot make a network namespace: {created.stderr.strip()}")
    try:
        steps = [
            ("link", "add", host_link, "type", "veth", "peer", "name", peer_link),
            ("link", "set", peer_link, "netns", namespace.name),
            ("addr", "add", f"{namespace.host_address}/30", "dev", host_link),
            ("link", "set", host_link, "up"),
            (
                "-n",
                namespace.name,
                "addr",
                "add",
                f"{namespace.client_address}/30",
                "dev",
                peer_link,
            ),
            ("-n", namespace.name, "link", "set", peer_link, "up"),
            ("-n", namespace.name, "link", "set", "lo", "up"),
        ]
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                pytest.skip(f"cannot wire the namespace (ip {' '.join(step)}): {done.stderr}")
        yield namespace
    finally:
        _ip("link", "del", host_link)  # takes its peer with it
        _ip("netns", "del", namespace.name)


@pytest.fixture
def start(netns: Namespace) -> Iterator[Any]:
    """Start `globalkv <args>` on the host side's address; stopped after the test."""
    procs: list[Proc] = []

    def started(command: str, *args: str, ready: str = "/health") -> str:
        port = netns.free_port()
        base = f"http://{netns.host_address}:{port}"
        proc = Proc.globalkv(
            command, "--host", netns.host_address, "--port", str(port), *args, name=command
        )
        procs.append(proc)
        proc.wait_http(base + ready)
        return base

    yield started
    for proc in procs:
        proc.stop()


def test_the_indexer_refuses_pods_and_lookups_from_another_host_and_answers_its_other_reads(
    netns: Namespace, start: Any
) -> None:
    indexer = start("indexer")
    pod = {"id": "p0", "kv_events": {"endpoint": "tcp://10.0.0.1:5557"}}
    (added, removed, listed, looked_up, health) = netns.requests(
        ("POST", f"{indexer}/v1/pods", {}, pod),
        ("DELETE", f"{indexer}/v1/pods/p0", {}, None),
        ("GET", f"{indexer}/v1/pods", {}, None),
        ("POST", f"{indexer}/v1/lookup", {}, {"model": "m", "token_ids": list(range(32))}),
        ("GET", f"{indexer}/health", {}, None),
    )
    assert added[0] == removed[0] == 403
    detail = json.loads(added[1])["detail"]
    assert f"{netns.client_address} is another host" in detail  # the peer, as seen there
    assert "GLOBALKV_INDEXER_ADMIN_TOKEN" in detail
    assert "GLOBALKV_INDEXER_INSECURE" in detail
    assert (listed[0], json.loads(listed[1])) == (200, {"pods": []})
    assert looked_up[0] == 403
    assert "GLOBALKV_INDEXER_OPEN_LOOKUPS" in json.loads(looked_up[1])["detail"]
    assert health[0] == 200


def test_insecure_and_a_token_let_another_host_register_pods(netns: Namespace, start: Any) -> None:
    pod = {"id": "p0", "kv_events": {"endpoint": "tcp://10.0.0.1:5557"}}
    insecure = start("indexer", "--insecure")
    assert netns.request("POST", f"{insecure}/v1/pods", pod)[0] == 201
    guarded = start("indexer", "--admin-token", "t0ken")
    auth = {"authorization": "Bearer t0ken"}
    assert netns.request("POST", f"{guarded}/v1/pods", pod)[0] == 401
    assert netns.request("POST", f"{guarded}/v1/pods", pod, auth)[0] == 201
    lookup = {"model": "m", "token_ids": list(range(32))}
    assert netns.request("POST", f"{guarded}/v1/lookup", lookup)[0] == 401
    assert netns.request("POST", f"{guarded}/v1/lookup", lookup, auth)[0] == 200
    opened = start("indexer", "--open-lookups")
    assert netns.request("POST", f"{opened}/v1/lookup", lookup)[0] == 200
    ipc = {"id": "p1", "kv_events": {"endpoint": "ipc:///run/engine.sock"}}
    status, text = netns.request("POST", f"{guarded}/v1/pods", ipc, auth)
    assert status == 400
    assert "--allow-endpoint-scheme ipc" in text


def test_the_gateway_refuses_worker_changes_from_another_host(netns: Namespace, start: Any) -> None:
    gateway = start(
        "gateway", "--decode", "http://127.0.0.1:9", "--prometheus-port", "0", "--pd-disaggregation"
    )
    worker = {"url": "http://10.0.0.3:30001", "role": "decode"}
    (added, removed, listed, health) = netns.requests(
        ("POST", f"{gateway}/workers", {}, worker),
        ("DELETE", f"{gateway}/workers/127.0.0.1:9", {}, None),
        ("GET", f"{gateway}/workers", {}, None),
        ("GET", f"{gateway}/health", {}, None),
    )
    assert added[0] == removed[0] == 403
    message = json.loads(added[1])["error"]["message"]
    assert "GLOBALKV_GATEWAY_ADMIN_TOKEN" in message
    assert "GLOBALKV_GATEWAY_INSECURE" in message
    assert [w["id"] for w in json.loads(listed[1])["workers"]] == ["127.0.0.1:9"]
    assert health[0] == 200


def test_a_directory_serves_sglangs_clients_from_another_host_but_refuses_a_reset(
    netns: Namespace, start: Any
) -> None:
    directory = start("bootstrap")
    snapshot = "prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
    rank = "prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
    answers = netns.requests(
        ("PUT", f"{directory}/route", {}, body(port=40001)),
        ("GET", f"{directory}/route?{snapshot}", {}, None),
        ("GET", f"{directory}/route?{rank}", {}, None),
        ("POST", f"{directory}/register_dp_rank", {}, {"bootstrap_room": 7, "dp_rank": 0}),
        ("POST", f"{directory}/query_dp_ranks", {}, {"bootstrap_rooms": [7]}),
        ("GET", f"{directory}/health", {}, None),
        ("DELETE", f"{directory}/v1/directory", {}, None),
        ("GET", f"{directory}/v1/directory", {}, None),
    )
    put, snap, one, room, query, health, reset, view = answers
    assert put == (200, "OK")
    assert snap[0] == 200
    assert json.loads(snap[1])["attn_tp_size"] == 1
    assert json.loads(one[1]) == {"rank_ip": "127.0.0.1", "rank_port": 40001}
    assert room == (200, "OK")
    assert (query[0], json.loads(query[1])) == (200, {"7": 0})
    assert health == (200, "OK")
    assert reset[0] == 403
    assert "GLOBALKV_BOOTSTRAP_ADMIN_TOKEN" in reset[1]
    assert json.loads(view[1])["registered"] == 1


_PUBLISHER = """
import json, sys
import zmq
endpoint, messages, wait = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3])
context = zmq.Context()
pub = context.socket(zmq.XPUB)
pub.connect(endpoint)
subscribed = bool(pub.poll(int(wait * 1000)))
if subscribed:
    pub.recv()
    for topic, seq, payload in messages:
        pub.send_multipart([topic.encode(), seq.to_bytes(8, "big"), bytes.fromhex(payload)])
pub.close(linger=5000)
context.term()
print(json.dumps(subscribed))
"""
"""An engine's PUB (an XPUB, to learn that the indexer's SUB subscribed): sends each
(topic, seq, payload hex) once subscribed, prints whether it ever was."""


def _stored(first: int) -> str:
    """A batch storing one 16-token block of tokens first..first+15, as hex."""
    tokens = list(range(first, first + 16))
    return msgpack.packb(
        [1.0, [["BlockStored", [first + 1], None, tokens, 16, None, "GPU"]], 0]
    ).hex()


def _publish(
    endpoint: str, messages: list[tuple[str, int, str]], netns: Namespace | None, wait: float = 5.0
) -> bool:
    """Publish from the namespace (another host) or, with None, from this one."""
    prefix = [] if netns is None else ["ip", "netns", "exec", netns.name]
    argv = [*prefix, sys.executable, "-c", _PUBLISHER, endpoint, json.dumps(messages), str(wait)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return bool(json.loads(done.stdout))


def _held(indexer: str, first: int) -> list[str]:
    """The pods holding the block of tokens first..first+15."""
    body = {"model": "m", "token_ids": list(range(first, first + 16))}
    answer = httpx.post(f"{indexer}/v1/lookup", json=body, timeout=5).json()
    return sorted(hit["pod"] for hit in answer["pods"])


def _bound_indexer(netns: Namespace, start: Any, *args: str) -> tuple[str, int]:
    """An indexer binding its SUB on every address, with a pod p0 that lives here (it
    published from loopback first) holding the block of tokens 0..15."""
    port = netns.free_port()
    # lookups opened: the test looks up from this host's address, which is not loopback
    indexer = start("indexer", "--bind", f"tcp://*:{port}", "--open-lookups", *args)
    assert _publish(f"tcp://127.0.0.1:{port}", [("kv@p0@m", 0, _stored(0))], None)
    wait_for(lambda: _held(indexer, 0) == ["p0"], timeout=10, what="p0's block")
    return indexer, port


def test_a_stranger_cannot_publish_to_the_bound_socket(netns: Namespace, start: Any) -> None:
    indexer, port = _bound_indexer(netns, start)
    wipe = ("kv@p0@m", 0, msgpack.packb([1.0, [], 0]).hex())  # "p0 restarted"
    forged = ("kv@p0@m", 1, _stored(100))
    assert not _publish(f"tcp://{netns.host_address}:{port}", [wipe, forged], netns, wait=2.0)
    wait_for(lambda: scrape(indexer, "globalkv_ingest_refused_publishers_total") >= 1)
    assert _held(indexer, 0) == ["p0"], "not wiped"
    assert _held(indexer, 100) == [], "no forged prefix"


def test_an_allowed_network_publishes_its_own_pods_but_not_another_hosts(
    netns: Namespace, start: Any
) -> None:
    indexer, port = _bound_indexer(netns, start, "--allow-publisher", f"{netns.client_address}/32")
    wipe = ("kv@p0@m", 0, msgpack.packb([1.0, [], 0]).hex())
    forged = ("kv@p0@m", 1, _stored(100))
    own = ("kv@far@m", 0, _stored(200))
    assert _publish(f"tcp://{netns.host_address}:{port}", [wipe, forged, own], netns)
    wait_for(lambda: _held(indexer, 200) == ["far"], timeout=10, what="far's block")
    assert scrape(indexer, "globalkv_ingest_dropped_total", reason="wrong_publisher") == 2
    assert _held(indexer, 0) == ["p0"], "not wiped"
    assert _held(indexer, 100) == [], "no forged prefix"
