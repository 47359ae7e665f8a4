"""The directory app behind httpx's ASGITransport, with its clock and metrics at hand."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bootstrap.server import BootstrapConfig, create_app
from tests.support.clock import FakeClock

SNAPSHOT = "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
NOT_READY = "Prefill server not fully registered yet ({} workers registered)."


def rank_url(dp: int, cp: int, tp: int, pp: int) -> str:
    return (
        f"/route?prefill_dp_rank={dp}&prefill_cp_rank={cp}&target_tp_rank={tp}&target_pp_rank={pp}"
    )


@dataclass
class Directory:
    app: FastAPI
    client: httpx.AsyncClient
    clock: FakeClock
    registry: CollectorRegistry

    async def put_all(self, bodies: list[dict[str, Any]]) -> None:
        for data in bodies:
            response = await self.client.put("/route", json=data)
            assert response.status_code == 200, response.text

    async def table(self) -> dict[str, Any]:
        view = (await self.client.get("/v1/directory")).json()
        assert isinstance(view, dict)
        return view

    def metric(self, name: str, **labels: str) -> float:
        for family in text_string_to_metric_families(_exposition(self.registry)):
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return sample.value
        raise AssertionError(f"no sample {name}{labels}")


def _exposition(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


async def open_directory(
    peer: tuple[str, int] = ("127.0.0.1", 123), **config: Any
) -> tuple[Directory, httpx.AsyncClient]:
    """A directory with `config`, and a client whose peer address is `peer`."""
    clock = FakeClock()
    registry = CollectorRegistry()
    app = create_app(BootstrapConfig(**config), clock=clock, registry=registry)
    transport = httpx.ASGITransport(app, client=peer)
    client = httpx.AsyncClient(transport=transport, base_url="http://directory")
    return Directory(app, client, clock, registry), client
