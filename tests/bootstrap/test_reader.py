"""The control plane's reading of our directory and of a real SGLang one."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest

from bootstrap.reader import DirectoryReader, DirectoryReport
from bootstrap.server import BootstrapConfig, create_app
from tests.bootstrap.factories import SGLANG_0_5_23_SNAPSHOT, body, instance
from tests.support.clock import FakeClock

URL = "http://10.0.0.9:8998"


async def read_app(*bodies: dict[str, object]) -> DirectoryReport:
    app = create_app(BootstrapConfig(), clock=FakeClock())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app)) as client:
        for data in bodies:
            assert (await client.put(f"{URL}/route", json=data)).status_code == 200
        return await DirectoryReader(client).read(URL)


async def read_mock(handler: Callable[[httpx.Request], httpx.Response]) -> DirectoryReport:
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        return await DirectoryReader(client, timeout=0.5).read(URL)


def sglang(snapshot: httpx.Response) -> Callable[[httpx.Request], httpx.Response]:
    """A real SGLang directory: no /v1/directory, only /route."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/route":
            assert dict(request.url.params) == {
                "prefill_dp_rank": "-1",
                "prefill_cp_rank": "-1",
                "target_tp_rank": "-1",
                "target_pp_rank": "-1",
            }
            return snapshot
        return httpx.Response(404, text="404: Not Found")

    return handle


async def test_our_directory_reports_missing_ranks() -> None:
    status = await read_app(body(tp=(0, 2), dp=(1, 2)))
    assert status == DirectoryReport(
        url=URL,
        reachable=True,
        ready=False,
        topology=status.topology,
        registered=1,
        expected=4,
        missing=[(0, 0, 0, 0), (0, 0, 1, 0), (1, 0, 1, 0)],
        error=None,
        flavor="globalkv",
    )
    assert status.topology is not None
    assert (status.topology["dp_size"], status.topology["attn_tp_size"]) == (2, 2)


async def test_our_ready_directory() -> None:
    status = await read_app(*instance(tp=2))
    assert (status.ready, status.registered, status.expected, status.missing) == (True, 2, 2, [])
    assert status.topology is not None
    assert status.topology["follow_bootstrap_room"] is True


async def test_our_empty_directory() -> None:
    status = await read_app()
    assert (status.reachable, status.ready, status.topology, status.expected) == (
        True,
        False,
        None,
        None,
    )


async def test_a_ready_sglang_directory_is_read_from_its_snapshot() -> None:
    snapshot = httpx.Response(200, content=SGLANG_0_5_23_SNAPSHOT.encode())
    status = await read_mock(sglang(snapshot))
    assert (status.flavor, status.reachable, status.ready, status.error) == (
        "sglang",
        True,
        True,
        None,
    )
    assert (status.registered, status.expected, status.missing) == (4, 4, [])
    assert status.topology is not None
    assert status.topology["prefill_http_port"] == 30000
    assert "target_tp_rank" not in status.topology


async def test_an_unready_sglang_directory_reports_its_count() -> None:
    text = "Prefill server not fully registered yet (3 workers registered)."
    status = await read_mock(sglang(httpx.Response(503, text=text)))
    assert (status.ready, status.registered, status.expected, status.error) == (
        False,
        3,
        None,
        None,
    )


@pytest.mark.parametrize(
    ("handler", "reachable", "error"),
    [
        (sglang(httpx.Response(500, text="boom")), True, "topology snapshot: HTTP 500: boom"),
        (sglang(httpx.Response(200, text="{")), True, "invalid topology snapshot"),
        (lambda r: httpx.Response(500, text="oops"), True, "/v1/directory: HTTP 500: oops"),
        (lambda r: httpx.Response(200, json={"ready": "yes"}), True, "invalid /v1/directory"),
    ],
)
async def test_bad_answers_become_errors_not_exceptions(
    handler: Callable[[httpx.Request], httpx.Response], reachable: bool, error: str
) -> None:
    status = await read_mock(handler)
    assert (status.reachable, status.ready) == (reachable, False)
    assert status.error is not None
    assert status.error.startswith(error)


async def test_an_unreachable_directory() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    status = await read_mock(refuse)
    assert (status.reachable, status.ready, status.flavor) == (False, False, None)
    assert status.error == "ConnectError: connection refused"


async def test_reads_use_the_configured_timeout() -> None:
    seen: list[object] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.extensions["timeout"]["read"])
        return httpx.Response(200, content=json.dumps({}).encode())

    await read_mock(handle)
    assert seen == [0.5]
