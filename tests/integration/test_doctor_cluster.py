"""`doctor` against a real local cluster: from the indexer alone, then with the indexer down.

(The healthy walk and a killed decode are covered through `globalkv up` in test_up_e2e.)
The second test stops the indexer and runs last; each works alone.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from globalkv.stack.cluster import LocalCluster, StackConfig
from globalkv.stack.doctor.diagnose import Doctor, DoctorConfig
from globalkv.stack.doctor.report import Level, Report

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    config = StackConfig(
        prefill=1,
        decode=1,
        prefill_args=["--prefill-tokens-per-s", "500000"],
        decode_args=["--decode-tokens-per-s", "5000"],
    )
    with LocalCluster(config) as running:
        yield running


async def diagnose(config: DoctorConfig) -> Report:
    async with httpx.AsyncClient() as client:
        return await Doctor(config, client).run()


def findings(report: Report, key: str) -> dict[str, tuple[Level, str]]:
    return {f.subject: (f.level, f.message) for f in report.stage(key).findings}


async def test_from_the_indexer_alone_prefills_are_found_through_its_pods(
    cluster: LocalCluster,
) -> None:
    report = await diagnose(DoctorConfig(indexer=cluster.indexer_url))
    assert report.healthy
    assert report.stage("gateway").level is Level.SKIP
    assert report.stage("probe").level is Level.SKIP
    level, message = findings(report, "directories")["pod prefill-0"]
    assert level is Level.OK
    assert "all 1 rank addresses accept connections" in message
    assert findings(report, "routing")["index lookups"][0] is Level.OK


async def test_an_index_that_is_down_is_the_first_failure(cluster: LocalCluster) -> None:
    cluster.kill("indexer")
    report = await diagnose(
        DoctorConfig(gateway=cluster.gateway_url, indexer=cluster.indexer_url, timeout=2)
    )
    assert report.first_failure is report.stage("index")
    assert findings(report, "index")["indexer"][1].startswith(
        f"{cluster.indexer_url}/health unreachable"
    )
    level, message = findings(report, "routing")["probe routing"]
    assert level is Level.FAIL
    assert "index_unavailable" in message
    # Requests still succeed: the gateway routes by load while the index is down.
    assert report.stage("probe").level is Level.OK
