"""A multi-node instance against a real `globalkv bootstrap` process.

Four rank processes ("nodes") register the eight ranks of a DP2 x TP4 instance to one
leader directory; a decode-side resolver reads it back and reaches every rank's live
socket; the directory is killed (the resolver's heartbeat drops the address), started
again empty on the same port, and the ranks' keep-alive fills it without any restart;
emptied by `DELETE /v1/directory`, it is filled again the same way.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bootstrap.reader import DirectoryReader
from bootstrap.resolver import DecodeResolver, DecodeTopology, ResolvedProducer
from tests.support.net import await_for, free_port
from tests.support.procs import Proc

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DP, TP = 2, 4


class Cluster:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: list[Proc] = []
        self.directory = self.start_directory()

    def start_directory(self) -> Proc:
        proc = Proc.globalkv(
            "bootstrap", "--host", "127.0.0.1", "--port", str(self.port), name="directory"
        )
        self.procs.append(proc)
        proc.wait_http(f"{self.url}/health")
        return proc

    def start_node(self, node: int) -> Proc:
        """Node n holds DP rank n // 2, TP ranks 2*(n % 2) and 2*(n % 2) + 1."""
        dp, first_tp = node // 2, 2 * (node % 2)
        ranks = ";".join(f"{dp},0,{tp},0" for tp in (first_tp, first_tp + 1))
        argv = [sys.executable, "-m", "tests.bootstrap.rank_process", "--url", self.url]
        argv += ["--ranks", ranks, "--dp-size", str(DP), "--tp-size", str(TP)]
        argv += ["--interval", "0.3"]
        proc = Proc(argv, env={"PYTHONPATH": str(ROOT)}, name=f"node{node}")
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    cluster = Cluster()
    try:
        yield cluster
    finally:
        cluster.stop()


async def identify(address: tuple[str, int]) -> str:
    reader, writer = await asyncio.wait_for(asyncio.open_connection(*address), timeout=5)
    line = await asyncio.wait_for(reader.readline(), timeout=5)
    writer.close()
    await writer.wait_closed()
    return line.decode().strip()


async def check_live(produced: ResolvedProducer) -> None:
    for rank in produced.ranks:
        address = (rank.address.rank_ip, rank.address.rank_port)
        assert await identify(address) == str(rank.coordinate)


async def test_multi_node_instance_resolves_and_survives_a_directory_restart(
    cluster: Cluster,
) -> None:
    for node in range(4):
        cluster.start_node(node)
    async with httpx.AsyncClient() as client:
        reader = DirectoryReader(client)

        async def ready() -> bool:
            return (await reader.read(cluster.url)).ready

        await await_for(ready, timeout=30, what="eight ranks from four nodes")
        status = await reader.read(cluster.url)
        assert (status.registered, status.expected, status.missing) == (8, 8, [])
        assert status.topology is not None
        assert (status.topology["dp_size"], status.topology["attn_tp_size"]) == (DP, TP)

        resolver = DecodeResolver(client)
        before = {}
        for rank in range(TP):
            room = 1000 + rank
            produced = await resolver.resolve(cluster.url, DecodeTopology(TP, rank), room)
            assert produced.dp_rank == room % DP
            assert [r.coordinate.tp_rank for r in produced.ranks] == [rank]
            await check_live(produced)
            before[rank] = produced.ranks
        narrow = await resolver.resolve(cluster.url, DecodeTopology(2, 1), room=7)
        assert [(r.coordinate.dp_rank, r.coordinate.tp_rank) for r in narrow.ranks] == [
            (1, 2),
            (1, 3),
        ]
        await check_live(narrow)

        assert cluster.directory.stop() == 0
        assert await resolver.check_health_once() == []
        assert await resolver.check_health_once() == [cluster.url]
        assert not (await reader.read(cluster.url)).reachable

        cluster.directory = cluster.start_directory()
        await await_for(ready, timeout=30, what="the keep-alive to refill the directory")
        for rank in range(TP):
            produced = await resolver.resolve(cluster.url, DecodeTopology(TP, rank), 1000 + rank)
            assert produced.ranks == before[rank]

        reset = await client.delete(f"{cluster.url}/v1/directory")
        assert reset.json()["dropped_ranks"] == 8
        await await_for(ready, timeout=30, what="the keep-alive to refill the reset directory")
    assert all(proc.alive() for proc in cluster.procs[1:5]), "no rank process restarted"
