"""Throw-away `redis-server`s for the index benchmarks (never the machine's own Redis): one,
or a local cluster."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import redis

from globalkv.stack.redis_cluster import LocalRedisCluster


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def redis_server() -> Iterator[int]:
    """Yields the port of a fresh, empty, non-persistent redis-server; stops it after."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed")
    port = _free_port()
    workdir = tempfile.mkdtemp(prefix="globalkv-bench-redis-")
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    argv += ["--appendonly", "no", "--dir", workdir, "--loglevel", "warning"]
    argv += ["--maxmemory-policy", "noeviction"]  # what RedisIndex requires
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("redis-server did not start")
            time.sleep(0.05)
        yield port
    finally:
        process.terminate()
        process.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


@contextmanager
def redis_cluster(masters: int = 3) -> Iterator[LocalRedisCluster]:
    """A fresh local Redis Cluster of `masters` masters, no replicas (the benchmarks'
    cluster column: replicas would only add replication work to the same two cores)."""
    cluster = LocalRedisCluster(masters=masters, replicas=0)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def cpu_seconds(ports: Sequence[int]) -> list[float]:
    """CPU seconds (user + system) each redis-server on `ports` has used so far."""
    out = []
    for port in ports:
        with redis.Redis(port=port, socket_timeout=5) as client:
            info = client.info("cpu")
        out.append(float(info["used_cpu_user"]) + float(info["used_cpu_sys"]))
    return out
