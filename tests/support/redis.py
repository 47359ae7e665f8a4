"""Throw-away `redis-server` processes on free ports (never the machine's own Redis)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis
import redis.asyncio as aioredis

from tests.support.net import free_port, wait_for


class RedisServer:
    def __init__(self, port: int | None = None, args: tuple[str, ...] = ()) -> None:
        """`args`: more redis-server flags (`--maxmemory 2mb`)."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (.ci/run installs it)")
        self.binary = binary
        self.port = port or free_port()
        self.args = args
        self.dir = tempfile.mkdtemp(prefix="globalkv-redis-")
        self.popen = self._spawn()

    def _spawn(self) -> subprocess.Popen[bytes]:
        popen = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
                "--loglevel",
                "warning",
                *self.args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.popen = popen
        wait_for(self._pings, timeout=10, what=f"redis-server on {self.port}")
        return popen

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _pings(self) -> bool:
        if self.popen.poll() is not None:
            raise RuntimeError(f"redis-server exited with {self.popen.returncode}")
        try:
            with redis.Redis(port=self.port, socket_timeout=0.5) as client:
                return bool(client.ping())
        except redis.ConnectionError:
            return False

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            self.popen.wait(10)

    def restart(self) -> None:
        """Stop and start again on the same port with an empty dataset."""
        self.stop()
        self._spawn()


@asynccontextmanager
async def write_torn(client: aioredis.Redis) -> AsyncIterator[None]:
    """Inside: the single connection of `client` (`single_connection_client=True`, already
    connected) lost its transport under redis-py, which then raises an AttributeError from
    asyncio's stream on the next write (redis/redis-py#3546). On leaving, the transport
    redis-py dropped is closed and the client with it."""
    connection = client.connection
    assert connection is not None
    assert connection._writer is not None
    writer = connection._writer
    transport = writer.transport
    writer._transport = None  # type: ignore[assignment]
    try:
        yield
    finally:
        writer._transport = transport
        transport.close()
        await client.aclose()
