"""KV capacity from what each engine publishes: our engines' and SGLang's /server_info,
vLLM's /metrics; and the monitor reading a vLLM prefill's from there."""

from __future__ import annotations

from gateway.settings.workers import KvEventsSpec, WorkerSpec
from gateway.workers.server_info import parse_server_info, parse_vllm_cache
from tests.gateway.fakes import Cluster, config, make_gateway

VLLM_METRICS = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="661"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="1",num_gpu_blocks="600"} 1.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


def test_sglang_s_capacity_is_its_token_pool_on_every_dp_rank() -> None:
    sglang = {"page_size": 64, "dp_size": 2, "max_total_num_tokens": 500_000}
    assert parse_server_info(sglang, "h").kv_capacity_tokens == 1_000_000
    assert parse_server_info({"max_total_num_tokens": 7}, "h").kv_capacity_tokens == 7
    for bad in (0, -1, "500000", True, None):
        info = {"page_size": 64, "max_total_num_tokens": bad}
        assert parse_server_info(info, "h").kv_capacity_tokens is None


def test_our_engines_kv_cache_block_wins_over_max_total_num_tokens() -> None:
    info = {"page_size": 16, "kv_cache": [{"capacity": 10}], "max_total_num_tokens": 999}
    assert parse_server_info(info, "h").kv_capacity_tokens == 160


def test_vllm_s_capacity_is_the_sum_over_its_engine_cores() -> None:
    assert parse_vllm_cache(VLLM_METRICS).capacity_tokens == (661 + 600) * 16


def test_vllm_metrics_without_a_filled_in_cache_config_tell_nothing() -> None:
    unprofiled = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n'
    zero = 'vllm:cache_config_info{block_size="0",num_gpu_blocks="10"} 1.0\n'
    for text in (unprofiled, zero, "", "not prometheus {{{", 'other_metric{a="1"} 2\n'):
        assert parse_vllm_cache(text).capacity_tokens is None


async def test_a_vllm_prefill_s_capacity_is_read_from_its_metrics() -> None:
    cluster = Cluster()
    cluster.metrics["10.0.0.1:30001"] = VLLM_METRICS
    spec = WorkerSpec(url="http://10.0.0.1:30001", role="prefill", kind="vllm")
    gateway = await make_gateway(cluster, config(prefill=[spec]))
    (candidate,) = gateway.pool.candidates("prefill", gateway.router.loads)
    assert candidate.cache_capacity_tokens == (661 + 600) * 16


async def test_an_sglang_prefill_s_metrics_are_not_asked_for_capacity() -> None:
    cluster = Cluster()
    cluster.metrics["10.0.0.1:30001"] = VLLM_METRICS
    spec = WorkerSpec(url="http://10.0.0.1:30001", role="prefill", kind="sglang")
    gateway = await make_gateway(cluster, config(prefill=[spec]))
    (candidate,) = gateway.pool.candidates("prefill", gateway.router.loads)
    assert candidate.cache_capacity_tokens is None


def test_sglang_s_kv_events_descriptor_is_dialled_at_the_worker_s_host() -> None:
    """SGLang's /server_info `kv_events`: a host (often a bind wildcard) and a base port,
    no URL; its replay endpoint is only in the `kv_events_config` server argument."""
    descriptor = {
        "publisher": "zmq",
        "endpoint_host": "*",
        "endpoint_port_base": 5557,
        "topic": "kv@p@m",
        "block_size": 32,
        "dp_size": 2,
    }
    info = {
        "page_size": 16,
        "dp_size": 2,
        "kv_events_config": '{"publisher": "zmq", "endpoint": "tcp://*:5557",'
        ' "replay_endpoint": "tcp://*:5560", "topic": "kv@p@m"}',
        "kv_events": descriptor,
    }
    found = parse_server_info(info, "10.0.0.7")
    assert found.kv_events == KvEventsSpec(
        endpoint="tcp://10.0.0.7:5557", replay_endpoint="tcp://10.0.0.7:5560", topic="kv@p@m"
    )
    assert (found.block_size, found.dp_size) == (32, 2)
    named = {**descriptor, "endpoint_host": "fd00::5"}
    spec = parse_server_info({**info, "kv_events": named}, "h").kv_events
    assert spec is not None
    assert spec.endpoint == "tcp://[fd00::5]:5557"


def test_a_descriptor_with_a_bad_port_falls_back_to_the_server_argument() -> None:
    config = '{"endpoint": "tcp://0.0.0.0:6000"}'
    for port in (0, 70000, "5557", None):
        block = {"endpoint_host": "*", "endpoint_port_base": port}
        spec = parse_server_info({"kv_events": block, "kv_events_config": config}, "h").kv_events
        assert spec is not None
        assert spec.endpoint == "tcp://h:6000"
    assert parse_server_info({"kv_events": {"endpoint_port_base": 0}}, "h").kv_events is None
