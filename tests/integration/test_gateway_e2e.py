"""The gateway end to end: real indexer, emulated engines and gateway processes.

One cluster serves the module, every process started here (not through `globalkv up`):
- prefill-a: DP 2 following the room, so a hit on one DP rank must be reached by a room
  with `room % 2 == rank`;
- prefill-b: DP 2 with round-robin DP choice, so it registers every room it serves in its
  own directory, where the test reads back what the prefill saw;
- prefill-c: TP 2, announced to the gateway with a standalone directory in which only
  rank 0 registered (a prefill instance whose second rank never came up);
- two decodes; the indexer, to which the gateway registers the prefills as pods.

The gateway logs each attempt's pair and rooms at debug level; the tests read it to know
which room a request carried. The killed-decode test changes the cluster and runs last.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.support.metrics import scrape
from tests.support.net import free_port, wait_for
from tests.support.procs import Proc

pytestmark = pytest.mark.integration

MODEL = "e2e-model"
PAGE = 16
BOS = 256
"""The byte tokenizer (engines' default, the gateway's `--tokenizer byte`): [BOS, *utf-8]."""
FAST = ("--prefill-tokens-per-s", "500000", "--prefill-overhead-ms", "1")
DECODE_RATE = 400
"""Decode tokens per second: a 200-token stream lasts half a second."""
ROUTE_LINE = re.compile(r"attempt \d+: prefill=(\S+) pod=(\S+) .* decode=(\S+) rooms=([\d,]+)")


@dataclass
class Engine:
    proc: Proc
    url: str
    info: dict[str, Any]

    @property
    def bootstrap(self) -> str:
        return f"http://127.0.0.1:{self.info['disaggregation_bootstrap_port']}"

    def metric(self, name: str, **labels: str) -> float:
        return scrape(self.url, name, **labels)


@dataclass
class Cluster:
    gateway: Proc
    gateway_url: str
    indexer_url: str
    prefills: dict[str, Engine]
    decodes: list[Engine]
    standalone: str
    """The directory prefill-c is announced with (rank 1 missing until a test adds it)."""

    def worker(self, url: str) -> dict[str, Any]:
        key = url.split("//", 1)[1]
        response = httpx.get(f"{self.gateway_url}/workers/{key}", timeout=5)
        assert response.status_code == 200, response.text
        found: dict[str, Any] = response.json()
        return found

    def routes(self) -> list[tuple[str, str, str, list[int]]]:
        """(prefill id, pod, decode id, rooms) of every attempt the gateway logged."""
        return [
            (m[1], m[2], m[3], [int(r) for r in m[4].split(",")])
            for m in ROUTE_LINE.finditer(self.gateway.log())
        ]


def _engine_argv(role: str, port: int, *extra: str) -> list[str]:
    argv = ["engine", "--role", role, "--port", str(port), "--model", MODEL, *FAST]
    argv += ["--decode-tokens-per-s", str(DECODE_RATE), "--page-size", str(PAGE)]
    if role == "prefill":
        argv += ["--bootstrap-port", "0", "--kv-events-endpoint", "tcp://*:0"]
        argv += ["--kv-events-replay-endpoint", "tcp://*:0", "--handshake-timeout", "3"]
    return [*argv, *extra]


def _adopt(proc: Proc, port: int) -> Engine:
    url = f"http://127.0.0.1:{port}"
    proc.wait_http(f"{url}/health")
    return Engine(proc, url, httpx.get(f"{url}/server_info", timeout=5).json())


def _registration(engine: Engine, tp_rank: int) -> dict[str, Any]:
    """The PUT /route body of one of `engine`'s ranks, as SGLang's prefill sends it."""
    query = f"prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank={tp_rank}&target_pp_rank=0"
    address = httpx.get(f"{engine.bootstrap}/route?{query}", timeout=5).json()
    return {
        **{"attn_tp_size": 2, "attn_tp_rank": tp_rank, "attn_cp_size": 1, "attn_cp_rank": 0},
        **{"attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0},
        **{"system_dp_size": 1, "system_dp_rank": 0, "page_size": PAGE},
        **{"kv_cache_dtype": "auto", "prefill_http_port": int(engine.url.rsplit(":", 1)[1])},
        "rank_ip": address["rank_ip"],
        "rank_port": address["rank_port"],
    }


def _cluster_ready(cluster: Cluster) -> bool:
    workers = {
        w["id"]: w for w in httpx.get(f"{cluster.gateway_url}/workers", timeout=5).json()["workers"]
    }
    if not all(w["health"] == "healthy" for w in workers.values()):
        return False
    prefills = [w for w in workers.values() if w["role"] == "prefill"]
    if not all(w["registered_pod"] for w in prefills):
        return False
    states = {w["pod"]: w["directory"] for w in prefills}
    if states != {"prefill-a": "ready", "prefill-b": "ready", "prefill-c": "not_ready"}:
        return False
    pods = httpx.get(f"{cluster.indexer_url}/v1/pods", timeout=5).json()["pods"]
    return all(p["state"] and p["state"]["subscribed"] for p in pods) and len(pods) == 3


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    procs: list[Proc] = []

    def spawn(*argv: str, name: str) -> Proc:
        proc = Proc.globalkv(*argv, name=name)
        procs.append(proc)
        return proc

    try:
        indexer_port, standalone_port = free_port(), free_port()
        indexer = spawn(
            *("indexer", "--host", "127.0.0.1", "--port", str(indexer_port)),
            *("--block-size", str(PAGE)),
            name="indexer",
        )
        standalone = spawn(
            "bootstrap", "--host", "127.0.0.1", "--port", str(standalone_port), name="directory"
        )
        specs = {
            "prefill-a": ("--dp", "2"),
            "prefill-b": ("--dp", "2", "--load-balance-method", "round_robin"),
            "prefill-c": ("--tp", "2"),
        }
        ports = {name: free_port() for name in [*specs, "decode-0", "decode-1"]}
        started = {
            name: spawn(*_engine_argv("prefill", ports[name], "--pod-id", name, *args), name=name)
            for name, args in specs.items()
        }
        for name in ("decode-0", "decode-1"):
            started[name] = spawn(*_engine_argv("decode", ports[name]), name=name)
        engines = {name: _adopt(proc, ports[name]) for name, proc in started.items()}
        indexer_url = f"http://127.0.0.1:{indexer_port}"
        standalone_url = f"http://127.0.0.1:{standalone_port}"
        indexer.wait_http(f"{indexer_url}/health")
        standalone.wait_http(f"{standalone_url}/health")
        put = httpx.put(
            f"{standalone_url}/route", json=_registration(engines["prefill-c"], 0), timeout=5
        )
        assert put.status_code == 200, put.text

        gateway_port = free_port()
        argv = ["gateway", "--pd-disaggregation", "--host", "127.0.0.1"]
        argv += ["--port", str(gateway_port), "--prometheus-port", "0"]
        for name in ("prefill-a", "prefill-b"):
            argv += ["--prefill", engines[name].url, str(engines[name].bootstrap.rsplit(":")[-1])]
        argv += ["--prefill", engines["prefill-c"].url, str(standalone_port)]
        argv += ["--decode", engines["decode-0"].url, "--decode", engines["decode-1"].url]
        argv += ["--indexer-url", indexer_url, "--model", MODEL, "--tokenizer", "byte"]
        argv += ["--decode-policy", "round_robin", "--worker-startup-check-interval", "0.1"]
        argv += ["--directory-refresh-secs", "0.1", "--router-log-level", "debug"]
        gateway = spawn(*argv, name="gateway")
        gateway_url = f"http://127.0.0.1:{gateway_port}"
        gateway.wait_http(f"{gateway_url}/liveness")
        built = Cluster(
            gateway,
            gateway_url,
            indexer_url,
            {name: engines[name] for name in specs},
            [engines["decode-0"], engines["decode-1"]],
            standalone_url,
        )
        wait_for(lambda: _cluster_ready(built), timeout=30, what="gateway, pods and directories")
        yield built
    finally:
        for proc in reversed(procs):
            proc.stop()


def _generate(cluster: Cluster, text: str, **fields: Any) -> dict[str, Any]:
    body = {"text": text, "sampling_params": {"max_new_tokens": 2}, **fields}
    response = httpx.post(f"{cluster.gateway_url}/generate", json=body, timeout=30)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def _lookup(cluster: Cluster, text: str) -> list[dict[str, Any]]:
    body = {"model": MODEL, "token_ids": [BOS, *text.encode()]}
    response = httpx.post(f"{cluster.indexer_url}/v1/lookup", json=body, timeout=5)
    assert response.status_code == 200, response.text
    pods: list[dict[str, Any]] = response.json()["pods"]
    return pods


def _prefix(tag: str) -> str:
    """A fresh prefix of exactly 10 pages once BOS is counted."""
    text = f"{tag}:{uuid.uuid4().hex} shared system prompt, " * 5
    return text[: 10 * PAGE - 1]


def _warm(cluster: Cluster, pod: str, prefix: str, **fields: Any) -> list[dict[str, Any]]:
    """Serve `prefix` on `pod` directly (no gateway) until the index shows the pod holds it.

    Each poke adds a fresh page behind the prefix, so a first batch the indexer's SUB
    missed is replayed once a later one reveals the gap.
    """
    engine = cluster.prefills[pod]

    def indexed() -> bool:
        poke = prefix + uuid.uuid4().hex[:PAGE]
        body = {"text": poke, "sampling_params": {"max_new_tokens": 1}, **fields}
        assert httpx.post(f"{engine.url}/generate", json=body, timeout=10).status_code == 200
        hits = _lookup(cluster, prefix)
        return any(h["pod"] == pod and h["hit_tokens"] == 10 * PAGE for h in hits)

    wait_for(indexed, timeout=20, what=f"{pod} holding the prefix in the index")
    return _lookup(cluster, prefix)


def test_a_shared_prefix_goes_to_the_pod_and_dp_rank_holding_it(cluster: Cluster) -> None:
    prefix = _prefix("a")
    hits = _warm(cluster, "prefill-a", prefix, routed_dp_rank=1)
    assert [(h["pod"], h["dp_rank"], h["hit_tokens"]) for h in hits] == [("prefill-a", 1, 160)]
    cached = {
        name: e.metric("globalkv_engine_prompt_tokens_total", kind="cached")
        for name, e in cluster.prefills.items()
    }

    for question in ("first question?", "second question?", "third question?"):
        meta = _generate(cluster, prefix + question)["meta_info"]
        assert meta["cached_tokens"] == 10 * PAGE
        assert meta["prefill_dp_rank"] == 1
        _, pod, _, rooms = cluster.routes()[-1]
        assert pod == "prefill-a"
        assert all(room % 2 == 1 for room in rooms)

    after = {
        name: e.metric("globalkv_engine_prompt_tokens_total", kind="cached")
        for name, e in cluster.prefills.items()
    }
    assert after["prefill-a"] - cached["prefill-a"] == 3 * 10 * PAGE
    assert after["prefill-b"] == cached["prefill-b"]
    assert after["prefill-c"] == cached["prefill-c"]
    assert scrape(cluster.gateway_url, "globalkv_gateway_chosen_hit_tokens_sum") >= 3 * 10 * PAGE


def test_the_prefill_and_the_decode_get_the_same_room(cluster: Cluster) -> None:
    prefix = _prefix("b")
    _warm(cluster, "prefill-b", prefix)
    for question in ("one?", "two?", "three?"):
        meta = _generate(cluster, prefix + question)["meta_info"]
        _, pod, _, (room,) = cluster.routes()[-1]
        assert pod == "prefill-b"
        seen = httpx.post(
            f"{cluster.prefills['prefill-b'].bootstrap}/query_dp_ranks",
            json={"bootstrap_rooms": [room]},
            timeout=5,
        ).json()
        # The prefill registered the room it was given; the decode found its own room
        # there (it reports the DP rank it read) and its room check passed (status 200).
        assert seen == {str(room): meta["prefill_dp_rank"]}
    for decode in cluster.decodes:
        assert decode.metric("globalkv_engine_room_check_failures_total") == 0


def test_a_stream_arrives_while_the_decode_still_produces_it(cluster: Cluster) -> None:
    body = {"text": "stream me " + uuid.uuid4().hex, "stream": True}
    body["sampling_params"] = {"max_new_tokens": 200}
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{cluster.gateway_url}/generate", json=body, timeout=30) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[len("data: ") :]))
            if len(events) == 1:
                # Held by the client before the decode has finished: nothing was buffered.
                assert events[0]["meta_info"]["finish_reason"] is None
                running = sum(d.metric("globalkv_engine_running_requests") for d in cluster.decodes)
                assert running == 1
    # One event per token as the decode produced it, then the finished one.
    assert [e["meta_info"]["completion_tokens"] for e in events] == [*range(1, 201), 200]
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 200}


def test_a_prefill_with_an_incomplete_directory_gets_no_traffic(cluster: Cluster) -> None:
    incomplete = cluster.prefills["prefill-c"]
    described = cluster.worker(incomplete.url)
    assert described["directory"] == "not_ready"
    assert (described["eligible"], described["health"]) == (False, "healthy")
    served = incomplete.metric("globalkv_engine_requests_total")
    for _ in range(12):
        _generate(cluster, _prefix("c"))
    assert incomplete.metric("globalkv_engine_requests_total") == served
    routed = {pod for _, pod, _, _ in cluster.routes()}
    assert routed
    assert "prefill-c" not in routed
    assert scrape(cluster.gateway_url, "globalkv_gateway_directory_ready", pod="prefill-c") == 0

    put = httpx.put(f"{cluster.standalone}/route", json=_registration(incomplete, 1), timeout=5)
    assert put.status_code == 200, put.text
    wait_for(
        lambda: cluster.worker(incomplete.url)["directory"] == "ready",
        timeout=10,
        what="prefill-c's directory read as ready",
    )

    def served_by_c() -> bool:
        _generate(cluster, _prefix("c"))
        return cluster.routes()[-1][1] == "prefill-c"

    # Now complete, the directory resolves to prefill-c's own ranks and requests succeed.
    wait_for(served_by_c, timeout=30, what="a request routed to prefill-c")
    assert incomplete.metric("globalkv_engine_requests_total") > served


def test_a_killed_decode_is_retried_on_the_other(cluster: Cluster) -> None:
    killed, survivor = cluster.decodes
    killed.proc.kill()
    before = len(cluster.routes())
    for stream in (False, False, True, True):
        body = {"text": _prefix("k"), "sampling_params": {"max_new_tokens": 3}, "stream": stream}
        response = httpx.post(f"{cluster.gateway_url}/generate", json=body, timeout=30)
        assert response.status_code == 200, response.text
    attempts = cluster.routes()[before:]
    dead, alive = killed.url.split("//")[1], survivor.url.split("//")[1]
    assert {decode for _, _, decode, _ in attempts} == {dead, alive}
    failed = [i for i, (_, _, decode, _) in enumerate(attempts) if decode == dead]
    # Every attempt on the dead decode was followed by one on the live decode, new rooms.
    for i in failed:
        assert attempts[i + 1][2] == alive
        assert not set(attempts[i + 1][3]) & set(attempts[i][3])
    retries = scrape(cluster.gateway_url, "globalkv_gateway_retries_total", role="decode")
    assert retries == len(failed) >= 1
    assert cluster.worker(killed.url)["consecutive_failures"] == len(failed)
