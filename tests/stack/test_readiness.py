"""Readiness of a planned cluster, read through a MockTransport: each condition in turn."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from globalkv.stack.config import StackConfig
from globalkv.stack.plan import Plan, plan_stack
from globalkv.stack.readiness import Readiness


@dataclass
class World:
    plan: Plan
    dead: set[str] = field(default_factory=set)
    registered: int = 1
    eligible: bool = True
    registered_pod: bool = True
    followed: bool = True
    subscribed: bool = True
    token: str | None = None
    """The gateway's admin token, which its /workers then needs."""

    def handle(self, request: httpx.Request) -> httpx.Response:
        base = f"http://{request.url.host}:{request.url.port}"
        if base in self.dead:
            raise httpx.ConnectError("refused", request=request)
        path = request.url.path
        if path == "/health":
            return httpx.Response(200)
        if path == "/v1/directory":
            ready = self.registered == 1
            body = {"ready": ready, "registered": self.registered, "expected": 1}
            return httpx.Response(200, json=body)
        if path == "/workers":
            if self.token and request.headers.get("authorization") != f"Bearer {self.token}":
                return httpx.Response(401, json={"error": {"message": "missing or wrong token"}})
            return httpx.Response(200, json={"workers": self._workers()})
        if path == "/v1/pods":
            pods = [{"id": "prefill-0", "state": {"subscribed": self.subscribed}}]
            return httpx.Response(200, json={"pods": pods if self.followed else []})
        return httpx.Response(404)

    def _workers(self) -> list[dict[str, Any]]:
        prefill, decode = self.plan.get("prefill-0"), self.plan.get("decode-0")
        return [
            {
                "id": "p",
                "url": prefill.url,
                "role": "prefill",
                "eligible": True,
                "directory": "ready",
                "registered_pod": "prefill-0" if self.registered_pod else None,
            },
            {
                "id": "d",
                "url": decode.url,
                "role": "decode",
                "eligible": self.eligible,
                "health": "healthy" if self.eligible else "unknown",
                "circuit": "closed",
            },
        ]


@pytest.fixture
def world(tmp_path: Path) -> World:
    config = StackConfig(prefill=1, decode=1)
    return World(plan_stack(config, itertools.count(9100), tmp_path))


def pending(world: World, token: str | None = None) -> list[str]:
    with httpx.Client(transport=httpx.MockTransport(world.handle)) as client:
        return Readiness(world.plan, client, token=token).pending()


def test_a_complete_cluster_is_ready(world: World) -> None:
    assert pending(world) == []


def test_a_gateway_with_the_clusters_token_is_read_with_it(world: World) -> None:
    world.token = "t0ken"
    assert pending(world) == ["gateway: /workers answered 401"]
    assert pending(world, "t0ken") == []


def test_an_engine_not_answering_yet(world: World) -> None:
    world.dead.add(world.plan.get("decode-0").url)
    assert pending(world) == ["decode-0: /health unreachable (ConnectError)"]


def test_an_incomplete_directory(world: World) -> None:
    world.registered = 0
    assert pending(world) == ["prefill-0: bootstrap directory has 0/1 ranks"]


def test_a_worker_the_gateway_does_not_route_to_yet(world: World) -> None:
    world.eligible = False
    assert pending(world) == ["gateway: decode-0 not eligible yet (health unknown, circuit closed)"]


def test_a_prefill_not_registered_with_the_index_yet(world: World) -> None:
    world.registered_pod = False
    assert pending(world) == ["gateway: has not registered prefill-0 with the index yet"]


def test_a_pod_the_indexer_does_not_follow_yet(world: World) -> None:
    world.followed = False
    assert pending(world) == ["indexer: does not follow pod prefill-0 yet"]
    world.followed, world.subscribed = True, False
    assert pending(world) == ["indexer: not subscribed to pod prefill-0 yet"]


def test_a_gateway_not_answering_yet(world: World) -> None:
    world.dead.add(world.plan.gateway.url)
    assert pending(world) == ["gateway: /workers unreachable (ConnectError)"]
