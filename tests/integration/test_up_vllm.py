"""`globalkv up --engine vllm`: a local cluster of vLLM-protocol engines, and `doctor` on it."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from globalkv.stack.cluster import LocalCluster, StackConfig
from globalkv.stack.doctor.diagnose import Doctor, DoctorConfig
from globalkv.stack.doctor.report import Level

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    config = StackConfig(
        prefill=2,
        decode=1,
        engine="vllm",
        prefill_args=["--prefill-tokens-per-s", "500000"],
        decode_args=["--decode-tokens-per-s", "5000"],
    )
    with LocalCluster(config) as running:
        yield running


def test_the_gateway_pairs_the_engines_as_vllm_workers(cluster: LocalCluster) -> None:
    workers = httpx.get(f"{cluster.gateway_url}/workers", timeout=5).json()["workers"]
    assert len(workers) == 3
    assert {w["kind"] for w in workers} == {"vllm"}
    body = {"model": "emulated-model", "prompt": "up in vllm mode", "max_tokens": 3}
    response = httpx.post(f"{cluster.gateway_url}/v1/completions", json=body, timeout=10)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


async def test_doctor_walks_a_vllm_cluster_and_its_repeat_is_served_from_cache(
    cluster: LocalCluster,
) -> None:
    config = DoctorConfig(gateway=cluster.gateway_url, indexer=cluster.indexer_url)
    async with httpx.AsyncClient() as client:
        report = await Doctor(config, client).run()
    assert report.healthy, report
    probe = {f.subject: f for f in report.stage("probe").findings}
    assert probe["answer"].level is Level.OK
    assert probe["stages"].message.startswith("vLLM pool")
    routing = {f.subject: f for f in report.stage("routing").findings}
    assert routing["repeated probe"].level is Level.OK
    workers = [f.subject for f in report.stage("gateway").findings if "127.0.0.1" in f.subject]
    assert len(workers) == 3
    assert all("[vLLM]" in subject for subject in workers)
    directories = report.stage("directories").findings
    assert {f.level for f in directories} == {Level.SKIP}
