"""`LocalCluster`, the Python API behind `globalkv up`, with real processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from globalkv.stack.cluster import ClusterError, LocalCluster, StackConfig

pytestmark = pytest.mark.integration

FAST = {
    "prefill_args": ["--prefill-tokens-per-s", "500000", "--prefill-overhead-ms", "1"],
    "decode_args": ["--decode-tokens-per-s", "5000"],
}


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("redis", ["redis_url", "redis_cluster_url"])
def test_a_redis_backed_cluster_serves_and_reports_a_death(
    redis: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """On one Redis and on a Redis Cluster (3 masters, 3 replicas)."""
    redis_url = request.getfixturevalue(redis)
    config = StackConfig(prefill=1, decode=2, redis_url=redis_url, run_dir=tmp_path / "run", **FAST)
    with LocalCluster(config) as cluster:
        assert [c.name for c in cluster.components] == [
            "indexer",
            "prefill-0",
            "decode-0",
            "decode-1",
            "gateway",
        ]
        assert all(c.alive for c in cluster.components)
        assert len(cluster.prefill_urls) == 1
        assert len(cluster.decode_urls) == 2
        pids = [c.pid for c in cluster.components]
        assert (tmp_path / "run" / "cluster.json").exists()
        assert (tmp_path / "run" / "gateway.log").exists()

        body = {"text": "a redis-backed index " * 8, "sampling_params": {"max_new_tokens": 2}}
        answer = httpx.post(f"{cluster.gateway_url}/generate", json=body, timeout=30)
        assert answer.status_code == 200, answer.text

        assert cluster.deaths() == []
        cluster.kill("decode-1")
        (death,) = cluster.deaths()
        assert (death.name, death.returncode) == ("decode-1", -9)
        assert "enginesim decode ready" in death.tail
        assert death.describe().startswith("decode-1 exited (signal 9); last lines of ")
        assert cluster.deaths() == []
        status = {c.name: c.returncode for c in cluster.components}
        assert status["decode-1"] == -9
        assert status["decode-0"] is None
        with pytest.raises(KeyError, match="no component 'decode-7'"):
            cluster.kill("decode-7")
    assert [pid for pid in pids if not _gone(pid)] == []


def test_a_component_that_cannot_start_is_reported_with_its_log(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = StackConfig(prefill=1, decode=1, gateway_port=port, run_dir=tmp_path, **FAST)
        cluster = LocalCluster(config)
        with pytest.raises(ClusterError) as failure:
            cluster.start()
    message = str(failure.value)
    assert "a component exited during start" in message
    assert "gateway exited (code " in message
    assert "address already in use" in message
    assert all(c.returncode is not None for c in cluster.components)


def test_a_cluster_starts_once() -> None:
    cluster = LocalCluster(StackConfig())
    with pytest.raises(ClusterError, match="has not been started"):
        _ = cluster.gateway_url


def test_with_an_admin_token_the_components_find_each_other_and_guard_their_state(
    tmp_path: Path,
) -> None:
    """Ready means the gateway registered its prefill with the indexer, which now takes
    only requests with the token; the token is on no command line and in no file."""
    token = "up-t0ken-" + os.urandom(4).hex()
    run_dir = tmp_path / "run"
    config = StackConfig(prefill=1, decode=1, run_dir=run_dir, admin_token=token, **FAST)
    auth = {"authorization": f"Bearer {token}"}
    with LocalCluster(config) as cluster, httpx.Client(timeout=10) as client:
        body = {"text": "guarded " * 8, "sampling_params": {"max_new_tokens": 2}}
        assert client.post(f"{cluster.gateway_url}/generate", json=body).status_code == 200
        new = {"url": "http://127.0.0.1:9", "role": "decode"}
        assert client.post(f"{cluster.gateway_url}/workers", json=new).status_code == 401
        added = client.post(f"{cluster.gateway_url}/workers", json=new, headers=auth)
        assert added.status_code == 201
        removed = client.delete(f"{cluster.gateway_url}/workers/127.0.0.1:9", headers=auth)
        assert removed.status_code == 200
        pod = {"id": "extra", "kv_events": {"endpoint": "tcp://127.0.0.1:9"}}
        assert client.post(f"{cluster.indexer_url}/v1/pods", json=pod).status_code == 401
        (prefill,) = [c for c in cluster.components if c.role == "prefill"]
        assert prefill.bootstrap_url is not None
        reset = client.delete(f"{prefill.bootstrap_url}/v1/directory")
        assert reset.status_code == 401
        for component in cluster.components:
            cmdline = Path(f"/proc/{component.pid}/cmdline").read_bytes()
            assert token.encode() not in cmdline, component.name
        assert token not in (run_dir / "cluster.json").read_text()

        doctor = [sys.executable, "-m", "globalkv", "doctor", "--run-dir", str(run_dir)]
        doctor.append("--no-probe")
        env = {k: v for k, v in os.environ.items() if not k.startswith("GLOBALKV_")}
        refused = subprocess.run(doctor, env=env, capture_output=True, text=True, timeout=60)
        assert refused.returncode == 1
        assert "GLOBALKV_DOCTOR_ADMIN_TOKEN" in refused.stdout
        env["GLOBALKV_DOCTOR_ADMIN_TOKEN"] = token
        read = subprocess.run(doctor, env=env, capture_output=True, text=True, timeout=60)
        assert read.returncode == 0, read.stdout + read.stderr
