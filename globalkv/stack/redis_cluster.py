"""A local Redis Cluster of `redis-server` processes, for trying cluster mode and for tests.

Masters and their replicas run on ports no other process was handed (`kvplumbing.ports`),
with the cluster bus on ports of its own (`cluster-port`, not the default port + 10000,
which may fall in the kernel's ephemeral range). `redis-cli --cluster create` assigns the
slots and the replicas; the cluster is ready when every node reports `cluster_state:ok`
and sees every master. Nothing is persisted: the data lives as long as the processes.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import redis

from kvplumbing.ports import unclaimed_ports

_HOST = "127.0.0.1"


class ClusterStartError(RuntimeError):
    """The cluster did not come up; the message says which step failed."""


@dataclass
class ClusterNode:
    port: int
    bus_port: int
    directory: Path
    popen: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{_HOST}:{self.port}"

    def client(self, timeout: float = 1.0) -> redis.Redis:
        return redis.Redis(_HOST, self.port, socket_timeout=timeout)


class LocalRedisCluster:
    """`masters` masters with `replicas` replicas each; `start` it, `stop` it after."""

    def __init__(
        self,
        masters: int = 3,
        replicas: int = 1,
        directory: Path | None = None,
        node_timeout_ms: int = 5000,
    ) -> None:
        """`node_timeout_ms`: Redis's `cluster-node-timeout`. A master unanswered that long
        is failed over (or, with no replica, the cluster is down until it answers): short
        enough for a trial to show a failover in seconds, long enough that a node starved of
        CPU on a loaded machine for a second is not taken for dead (at 1,000 ms, a loaded
        2-core machine answered CLUSTERDOWN in the middle of a test)."""
        if node_timeout_ms < 100:
            raise ValueError("node_timeout_ms must be at least 100")
        self.node_timeout_ms = node_timeout_ms
        if masters < 3:
            raise ValueError("a Redis Cluster needs at least 3 masters")
        if replicas < 0:
            raise ValueError("replicas must be 0 or more")
        binary, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if binary is None or cli is None:
            raise ClusterStartError("redis-server and redis-cli must be installed")
        self.binary, self.cli = binary, cli
        self.masters, self.replicas = masters, replicas
        self._owned = directory is None
        root = directory or Path(tempfile.mkdtemp(prefix="globalkv-redis-cluster-"))
        self.directory = root
        count = masters * (1 + replicas)
        ports = unclaimed_ports(2 * count)
        self.nodes = [
            ClusterNode(ports[i], ports[count + i], root / f"node-{i}") for i in range(count)
        ]

    @property
    def url(self) -> str:
        """The seed URL every globalkv component takes (`redis+cluster://` + masters)."""
        seeds = ",".join(node.address for node in self.nodes[: self.masters])
        return f"redis+cluster://{seeds}/"

    def start(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        try:
            for node in self.nodes:
                self.spawn(node)
            for node in self.nodes:
                self._wait(deadline, f"redis-server on {node.port}", partial(_pings, node))
            self._create(deadline)
            self.wait_ok(deadline - time.monotonic())
        except BaseException:
            self.stop()
            raise

    def spawn(self, node: ClusterNode) -> None:
        """Start (or start again) one node's process, keeping its cluster config."""
        node.directory.mkdir(parents=True, exist_ok=True)
        node.popen = subprocess.Popen(
            [
                self.binary,
                "--port", str(node.port),
                "--bind", _HOST,
                "--cluster-enabled", "yes",
                "--cluster-port", str(node.bus_port),
                "--cluster-config-file", str(node.directory / "nodes.conf"),
                "--cluster-node-timeout", str(self.node_timeout_ms),
                "--save", "",
                "--appendonly", "no",
                "--maxmemory-policy", "noeviction",
                "--dir", str(node.directory),
                "--loglevel", "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def _create(self, deadline: float) -> None:
        argv = [self.cli, "--cluster", "create", *(n.address for n in self.nodes)]
        argv += ["--cluster-replicas", str(self.replicas), "--cluster-yes"]
        try:
            done = subprocess.run(
                argv,
                capture_output=True,
                timeout=max(1.0, deadline - time.monotonic()),
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise ClusterStartError("redis-cli --cluster create did not finish") from exc
        if done.returncode:
            tail = done.stdout.decode(errors="replace")[-2000:]
            raise ClusterStartError(f"redis-cli --cluster create failed: {tail}")

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every running node says `cluster_state:ok` and knows all the masters."""
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            if node.popen is not None and node.popen.poll() is None:
                self._wait(deadline, f"cluster_state:ok on {node.port}", partial(self._ok, node))

    def _ok(self, node: ClusterNode) -> bool:
        try:
            with node.client() as client:
                info = client.execute_command("CLUSTER", "INFO")
        except redis.RedisError:
            return False
        text = info.decode() if isinstance(info, bytes) else str(info)
        fields = dict(line.split(":", 1) for line in text.split() if ":" in line)
        size = int(fields.get("cluster_size", 0))
        return fields.get("cluster_state") == "ok" and size >= self.masters

    def _wait(self, deadline: float, what: str, ready: Callable[[], bool]) -> None:
        while not ready():
            if time.monotonic() > deadline:
                raise ClusterStartError(f"timed out waiting for {what}")
            time.sleep(0.05)

    def master_ports(self) -> list[int]:
        """Ports of the nodes that are masters now (a failover changes them)."""
        ports = []
        for node in self.nodes:
            if node.popen is None or node.popen.poll() is not None:
                continue
            try:
                with node.client() as client:
                    role = client.execute_command("ROLE")[0]
            except redis.RedisError:
                continue
            if role in (b"master", "master"):
                ports.append(node.port)
        return ports

    def kill(self, port: int) -> None:
        """SIGKILL one node (a crash: no shutdown, nothing saved)."""
        for node in self.nodes:
            if node.port == port and node.popen is not None:
                node.popen.kill()
                node.popen.wait(10)

    def stop(self) -> None:
        for node in self.nodes:
            if node.popen is not None and node.popen.poll() is None:
                node.popen.terminate()
        for node in self.nodes:
            if node.popen is not None:
                try:
                    node.popen.wait(10)
                except subprocess.TimeoutExpired:
                    node.popen.kill()
                    node.popen.wait(10)
        if self._owned:
            shutil.rmtree(self.directory, ignore_errors=True)


def _pings(node: ClusterNode) -> bool:
    if node.popen is not None and node.popen.poll() is not None:
        raise ClusterStartError(f"redis-server on {node.port} exited with {node.popen.returncode}")
    try:
        with node.client(0.5) as client:
            return bool(client.ping())
    except redis.RedisError:
        return False
