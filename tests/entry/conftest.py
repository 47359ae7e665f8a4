"""Pickers over fake workers for the ext_proc tests (`tests.entry.ext_proc`)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from gateway.settings.workers import WorkerSpec
from globalkv.lookup import LookupResult, PodHit
from tests.entry.ext_proc import A, B, Epp, serve_epp
from tests.gateway.fakes import PREFILLS, Cluster, StubLookup, config, make_gateway


@pytest.fixture
async def aggregated() -> AsyncIterator[Epp]:
    hit = LookupResult(block_size=4, blocks=3, pods=[PodHit(B, 0, 3, 12, 3.0)])
    workers = [WorkerSpec(url=u, role="prefill") for u in PREFILLS]
    gateway = await make_gateway(
        Cluster(), config(prefill=workers, decode=[]), lookup=StubLookup(hit)
    )
    async for epp in serve_epp(gateway, fallbacks=1, shed_in_flight=2):
        yield epp


@pytest.fixture
async def disaggregated() -> AsyncIterator[Epp]:
    hit = LookupResult(block_size=4, blocks=3, pods=[PodHit(A, 0, 3, 12, 3.0)])
    gateway = await make_gateway(Cluster(), config(), lookup=StubLookup(hit))
    async for epp in serve_epp(gateway):
        yield epp
