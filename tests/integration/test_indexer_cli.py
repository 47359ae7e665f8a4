"""`globalkv indexer` as a real process, with an engine publisher connecting to its bound
socket and another it subscribes to, and the `lookup` / `pods` commands reading it."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
import zmq.asyncio

from tests.ingest.publisher_proc import PublisherProc, chain
from tests.support.net import await_for, free_port
from tests.support.procs import Proc

pytestmark = pytest.mark.integration

BS = 4
PROMPT = list(range(40, 56))


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "globalkv", *args], capture_output=True, text=True, timeout=60
    )


async def test_indexer_process_end_to_end(context: zmq.asyncio.Context) -> None:
    port, bind_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    indexer = Proc.globalkv(
        "indexer",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--block-size",
        str(BS),
        "--bind",
        f"tcp://127.0.0.1:{bind_port}",
        "--admin-token",
        "t0k",
        "--tokenizer",
        "byte",
        name="indexer",
    )
    bound = await PublisherProc.start(
        context, connect_to=f"tcp://127.0.0.1:{bind_port}", topic="kv@b0@m", name="pub-b0"
    )
    connected = await PublisherProc.start(context, name="pub-c0")
    try:
        indexer.wait_http(f"{url}/health")
        async with httpx.AsyncClient(base_url=url, timeout=5) as client:
            pod = {
                "id": "c0",
                "model": "m",
                "block_size": 8,
                "kv_events": {
                    "endpoint": connected.endpoint,
                    "replay_endpoint": connected.replay_endpoint,
                },
            }
            assert (await client.post("/v1/pods", json=pod)).status_code == 401
            auth = {"authorization": "Bearer t0k"}
            assert (await client.post("/v1/pods", json=pod, headers=auth)).status_code == 201
            await connected.call(op="wait_subscribed")
            await bound.call(op="wait_subscribed")
            await connected.publish(chain(PROMPT, 8, first_hash=1))
            await bound.publish(chain(PROMPT[:8], BS, first_hash=1))
            await bound.raw(b"garbage")

            async def both_visible() -> bool:
                body = {"model": "m", "token_ids": PROMPT}
                answer = await client.post("/v1/lookup", json=body, headers=auth)
                depths = {p["pod"]: p["hit_blocks"] for p in answer.json()["pods"]}
                return depths == {"c0": 4, "b0": 2}

            await await_for(both_visible, timeout=20, what="both pods in lookups")
            metrics = (await client.get("/metrics")).text
            assert 'globalkv_ingest_dropped_total{reason="bad_frames"} 1.0' in metrics

        tokens = ",".join(map(str, PROMPT))
        refused = cli("lookup", "--indexer", url, "--model", "m", "--tokens", tokens)
        assert refused.returncode == 1
        assert "401" in refused.stderr  # lookups are tenants' data: the token is needed
        token = ("--admin-token", "t0k")
        shown = cli("lookup", "--indexer", url, "--model", "m", "--tokens", tokens, *token)
        assert shown.returncode == 0, shown.stderr
        lines = shown.stdout.splitlines()
        assert lines[0] == "block size 4, prompt blocks 4"
        assert lines[2].split()[:4] == ["c0", "0", "4", "16"]
        assert lines[3].split()[:4] == ["b0", "0", "2", "8"]

        text = cli("lookup", "--indexer", url, "--model", "m", "--text", "hello", *token)
        assert text.returncode == 0, text.stderr
        assert "no pod holds" in text.stdout

        pods = cli("pods", "--indexer", url)
        assert pods.returncode == 0, pods.stderr
        rows = {line.split()[0]: line.split() for line in pods.stdout.splitlines()[1:]}
        assert set(rows) == {"b0", "c0"}
        assert rows["c0"][6:9] == ["yes", "yes", "0"]
        assert rows["c0"][5] == rows["b0"][5] != "-"  # this indexer follows both
        assert rows["b0"][4] == "bind:kv@b0@m"

        down = cli("pods", "--indexer", f"http://127.0.0.1:{free_port()}")
        assert down.returncode == 1
        assert "cannot reach" in down.stderr
    finally:
        bound.stop()
        connected.stop()
        assert indexer.stop() == 0, indexer.log()
