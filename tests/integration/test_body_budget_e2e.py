"""Many unfinished large bodies against real gateway and sidecar processes.

Each process runs with a 4 MiB per-request cap and a 16 MiB total in front of emulated
SGLang engines. Forty clients each start a body at the cap and never finish it (half by
Content-Length, half chunked), sending in turns until the process refuses them: without
the total the process would hold 160 MiB of them. The process's peak resident memory grows
by far less, the bytes it reports holding stay within the total, the refused clients read
a 503 naming `--max-buffered-payload-size`, an ordinary request is still served, and
every byte comes back once the clients leave.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.enginesim.cluster import EngineProc, engines
from tests.support.metrics import scrape
from tests.support.net import await_for, free_port, wait_for
from tests.support.procs import Proc

pytestmark = pytest.mark.integration

MiB = 1024 * 1024
CAP = 4 * MiB
TOTAL = 16 * MiB
CLIENTS = 40
PIECE = 256 * 1024
HELD = "globalkv_gateway_request_body_bytes"


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[EngineProc, EngineProc]]:
    with engines(("prefill", []), ("decode", [])) as (prefill, decode):
        yield prefill, decode


@pytest.fixture(params=["gateway", "sidecar"])
def process(
    request: pytest.FixtureRequest, pair: tuple[EngineProc, EngineProc]
) -> Iterator[tuple[str, Proc]]:
    prefill, decode = pair
    port = free_port()
    proc = Proc.globalkv(
        *(request.param, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", "0"),
        *("--prefill", prefill.url, str(prefill.bootstrap_port), "--decode", decode.url),
        *("--max-payload-size", str(CAP), "--max-buffered-payload-size", str(TOTAL)),
        *("--worker-startup-check-interval", "0.1"),
        name=request.param,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(f"{url}/health")
        wait_for(lambda: _served(url).status_code == 200, timeout=30, what="a first answer")
        yield url, proc
    finally:
        proc.stop()


def _served(url: str) -> httpx.Response:
    body = {"model": "m", "prompt": "hello there", "max_tokens": 2}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=30)


def _memory(pid: int, field: str) -> int:
    """VmRSS or VmHWM (the peak) of process `pid`, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for {pid}")


class Upload:
    """One client's body, started and left unfinished; `answer` completes on a refusal."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.answer = asyncio.ensure_future(reader.read())
        self.chunked = False

    @classmethod
    async def start(cls, port: int, chunked: bool) -> Upload:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        framing = "transfer-encoding: chunked" if chunked else f"content-length: {CAP}"
        writer.write(f"POST /v1/completions HTTP/1.1\r\nhost: t\r\n{framing}\r\n\r\n".encode())
        upload = cls(reader, writer)
        upload.chunked = chunked
        return upload

    async def send(self) -> None:
        piece = b"x" * PIECE
        self.writer.write(b"%x\r\n%s\r\n" % (PIECE, piece) if self.chunked else piece)
        try:
            async with asyncio.timeout(30):
                await self.writer.drain()
        except ConnectionError:
            await self.answer  # refused: the answer and the close are on their way


async def test_unfinished_bodies_stay_within_the_total_and_a_request_is_served(
    process: tuple[str, Proc],
) -> None:
    url, proc = process
    port = int(url.rsplit(":", 1)[1])
    pid = proc.popen.pid
    before = _memory(pid, "VmRSS")
    uploads = [await Upload.start(port, chunked=n % 2 == 1) for n in range(CLIENTS)]
    try:
        for _ in range(CAP // PIECE - 1):  # every body a piece short of its end
            live = [u for u in uploads if not u.answer.done()]
            await asyncio.gather(*(u.send() for u in live))
            assert scrape(url, HELD) <= TOTAL
        refused = [u for u in uploads if u.answer.done()]
        assert refused, "the total was never reached"
        for upload in refused:
            head, _, body = (await upload.answer).partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503"), head
            error = json.loads(body)["error"]
            assert f"--max-buffered-payload-size ({TOTAL} bytes)" in error["message"]
        assert 0 < scrape(url, HELD) <= TOTAL
        answered = await asyncio.to_thread(_served, url)
        assert answered.status_code == 200, answered.text
        growth = _memory(pid, "VmHWM") - before
        assert growth < 80 * MiB, f"peak memory grew {growth / MiB:.0f} MiB"
    finally:
        for upload in uploads:
            upload.writer.close()
            upload.answer.cancel()
        closed = (u.writer.wait_closed() for u in uploads)
        await asyncio.gather(*closed, return_exceptions=True)

    async def given_back() -> bool:
        return await asyncio.to_thread(scrape, url, HELD) == 0

    await await_for(given_back, timeout=20, what="every body given back")
