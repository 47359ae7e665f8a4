"""Who may reset a directory: protected mode on our reset, never on SGLang's paths.

Peers are told apart by the address the ASGI transport reports; a client in another
network namespace is `tests/integration/test_protected_netns.py`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import httpx
import pytest

from bootstrap.server import BootstrapConfig, BootstrapServer, create_app
from kvplumbing.auth import PUBLISHED_DEFAULT_TOKEN, ProtectionFlags
from tests.bootstrap.factories import instance
from tests.bootstrap.served import SNAPSHOT, Directory, open_directory, rank_url

REMOTE = ("10.213.0.2", 40000)
LOCAL = ("127.0.0.1", 40000)
Open = Callable[..., AbstractAsyncContextManager[Directory]]


@pytest.fixture
def open_at() -> Open:
    @asynccontextmanager
    async def make(peer: tuple[str, int], **config: Any) -> AsyncIterator[Directory]:
        directory, client = await open_directory(peer, **config)
        async with client:
            yield directory

    return make


async def test_sglang_paths_answer_another_host_as_sglang_does(open_at: Open) -> None:
    """What SGLang's prefill ranks and decodes send carries no credentials: nothing of it
    may be refused for the host it comes from."""
    async with open_at(REMOTE) as directory:
        client = directory.client
        await directory.put_all(instance(tp=2))
        snapshot = await client.get(SNAPSHOT)
        assert snapshot.status_code == 200
        assert (await client.get(rank_url(0, 0, 1, 0))).status_code == 200
        room = {"bootstrap_room": 7, "dp_rank": 0}
        assert (await client.post("/register_dp_rank", json=room)).text == "OK"
        queried = await client.post("/query_dp_ranks", json={"bootstrap_rooms": [7]})
        assert queried.json() == {"7": 0}
        assert (await client.get("/health")).text == "OK"
        assert (await client.head("/health")).status_code == 200
        assert (await client.get("/v1/directory")).json()["ready"] is True
        assert (await client.get("/metrics")).status_code == 200


async def test_a_reset_from_another_host_is_refused_without_a_token(
    open_at: Open, caplog: pytest.LogCaptureFixture
) -> None:
    async with open_at(REMOTE) as directory:
        await directory.put_all(instance(tp=2))
        caplog.set_level(logging.WARNING, logger="bootstrap.server")
        refused = await directory.client.delete("/v1/directory")
        assert refused.status_code == 403
        assert refused.headers["content-type"].startswith("text/plain")
        for words in ("DELETE /v1/directory", "10.213.0.2", "protected mode"):
            assert words in refused.text
        assert "`--admin-token` (GLOBALKV_BOOTSTRAP_ADMIN_TOKEN)" in refused.text
        assert "`--insecure` (GLOBALKV_BOOTSTRAP_INSECURE)" in refused.text
        view = await directory.table()
        assert (view["ready"], view["registered"]) == (True, 2)
        assert "directory reset refused for 10.213.0.2 (HTTP 403)" in caplog.text


async def test_a_reset_from_this_machine_needs_no_token(open_at: Open) -> None:
    async with open_at(LOCAL) as directory:
        await directory.put_all(instance(tp=2))
        assert (await directory.client.delete("/v1/directory")).status_code == 200
        assert (await directory.table())["registered"] == 0


async def test_insecure_lets_any_host_reset(open_at: Open) -> None:
    async with open_at(REMOTE, insecure=True) as directory:
        await directory.put_all(instance(tp=2))
        assert (await directory.client.delete("/v1/directory")).status_code == 200


@pytest.mark.parametrize("peer", [LOCAL, REMOTE])
async def test_with_a_token_every_reset_needs_it_and_sglang_paths_do_not(
    open_at: Open, peer: tuple[str, int]
) -> None:
    async with open_at(peer, admin_token="t0ken") as directory:
        await directory.put_all(instance(tp=2))
        refused = await directory.client.delete("/v1/directory")
        assert refused.status_code == 401
        assert "GLOBALKV_BOOTSTRAP_ADMIN_TOKEN" in refused.text
        assert "t0ken" not in refused.text
        auth = {"authorization": "Bearer t0ken"}
        reset = await directory.client.delete("/v1/directory", headers=auth)
        assert reset.json() == {"dropped_ranks": 2, "dropped_rooms": 0}


async def test_an_embedding_command_names_its_own_flags() -> None:
    flags = ProtectionFlags("engine", "--bootstrap-admin-token", "--bootstrap-insecure")
    app = create_app(BootstrapConfig(), flags=flags)
    transport = httpx.ASGITransport(app, client=REMOTE)
    async with httpx.AsyncClient(transport=transport, base_url="http://d") as client:
        refused = await client.delete("/v1/directory")
    assert refused.status_code == 403
    assert "GLOBALKV_ENGINE_BOOTSTRAP_ADMIN_TOKEN" in refused.text
    assert "GLOBALKV_ENGINE_BOOTSTRAP_INSECURE" in refused.text


def test_the_published_default_token_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="bootstrap.server")
    BootstrapServer(BootstrapConfig(admin_token=PUBLISHED_DEFAULT_TOKEN))
    assert "docker-compose.yml's default" in caplog.text
