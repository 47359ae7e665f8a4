"""Whatever arrives, the directory answers 4xx (never 5xx) and keeps its table intact."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bootstrap.protocol import ROUTE_PARAMS, RankRegistration, RoomQuery, RoomRegistration
from bootstrap.server import BootstrapConfig, create_app
from tests.bootstrap.factories import SGLANG_0_5_23_PUT, body
from tests.support.clock import FakeClock

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def mutated_registrations(draw: st.DrawFn) -> dict[str, Any]:
    """A valid registration with some fields dropped or replaced by arbitrary JSON."""
    data: dict[str, Any] = body(tp=(1, 2), rank_ip="10.1.1.1")
    fields = draw(st.lists(st.sampled_from(sorted(SGLANG_0_5_23_PUT)), min_size=1, max_size=4))
    for name in fields:
        if draw(st.booleans()):
            data.pop(name, None)
        else:
            data[name] = draw(json_values)
    return data


@asynccontextmanager
async def directory_with_one_rank() -> AsyncIterator[tuple[httpx.AsyncClient, dict[str, Any]]]:
    """A directory holding rank TP0 of a TP2 instance, and its /v1/directory view."""
    app = create_app(BootstrapConfig(), clock=FakeClock())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://d") as client:
        assert (await client.put("/route", json=body(tp=(0, 2)))).status_code == 200
        yield client, (await client.get("/v1/directory")).json()


@FUZZ
@given(data=mutated_registrations())
async def test_any_registration_body_is_either_valid_or_refused_without_change(
    data: dict[str, Any],
) -> None:
    async with directory_with_one_rank() as (client, before):
        response = await client.put("/route", json=data)
        after = (await client.get("/v1/directory")).json()
    assert response.status_code in (200, 400, 422), response.text
    if response.status_code == 200:
        assert RankRegistration.model_validate(data)
    else:
        assert response.text
        assert after == before


@FUZZ
@given(
    raw=st.binary(max_size=64)
    | json_values.map(lambda v: json.dumps(v).encode())
    | st.sampled_from([b"NaN", b'{"bootstrap_room": Infinity, "dp_rank": 0}', b"[" * 5000])
)
async def test_any_bytes_on_any_write_endpoint_get_a_4xx_or_a_valid_answer(raw: bytes) -> None:
    async with directory_with_one_rank() as (client, before):
        for path, model in (
            ("/route", RankRegistration),
            ("/register_dp_rank", RoomRegistration),
            ("/query_dp_ranks", RoomQuery),
        ):
            method = "PUT" if path == "/route" else "POST"
            response = await client.request(method, path, content=raw)
            assert response.status_code < 500, (path, response.text)
            if response.status_code >= 400:
                assert response.text
            else:
                assert model.model_validate_json(raw)
        view = (await client.get("/v1/directory")).json()
    assert view["ranks"] == before["ranks"]


@FUZZ
@given(
    params=st.dictionaries(
        st.sampled_from([*ROUTE_PARAMS, "other"]),
        st.text(max_size=12) | st.integers(min_value=-3, max_value=3).map(str),
        max_size=5,
    )
)
async def test_any_route_query_gets_a_protocol_answer(params: dict[str, str]) -> None:
    async with directory_with_one_rank() as (client, _):
        assert (await client.put("/route", json=body(tp=(1, 2)))).status_code == 200
        response = await client.get("/route", params=params)
    assert response.status_code in (200, 400, 404), response.text
    if response.status_code == 400:
        assert "Missing inputs" in response.text or "must be decimal integers" in response.text
