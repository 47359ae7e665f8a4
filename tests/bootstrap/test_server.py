"""Every endpoint, status and text of PROTOCOLS §1, through the ASGI app."""

from __future__ import annotations

import json

import pytest

from bootstrap.protocol import COMPAT_VERSIONS, CompatVersion, snapshot_keys
from bootstrap.routes import MAX_BODY_BYTES
from tests.bootstrap.asgi import Exchange
from tests.bootstrap.factories import SGLANG_0_5_23_PUT, body, instance
from tests.bootstrap.served import NOT_READY, SNAPSHOT, Directory, open_directory, rank_url

# ---- /health and method handling ---------------------------------------------------------


async def test_health_answers_ok_to_get_and_head(directory: Directory) -> None:
    response = await directory.client.get("/health")
    assert (response.status_code, response.text) == (200, "OK")
    assert response.headers["content-type"] == "text/plain; charset=utf-8"
    assert (await directory.client.head("/health")).status_code == 200


@pytest.mark.parametrize("method", ["POST", "DELETE", "PATCH", "OPTIONS", "HEAD"])
async def test_other_methods_on_route_get_405(directory: Directory, method: str) -> None:
    response = await directory.client.request(method, "/route")
    assert response.status_code == 405
    if method != "HEAD":
        assert response.text == "Method not allowed"


# ---- PUT /route ------------------------------------------------------------------------


async def test_sglang_registration_is_accepted_with_ok(directory: Directory) -> None:
    response = await directory.client.put("/route", json=SGLANG_0_5_23_PUT)
    assert (response.status_code, response.text) == (200, "OK")
    assert response.headers["content-type"] == "text/plain; charset=utf-8"
    view = await directory.table()
    assert view["registered"] == 1
    assert view["ranks"][0] | {"registered_at": 0} == {
        "dp_rank": 1,
        "cp_rank": 0,
        "tp_rank": 1,
        "pp_rank": 0,
        "rank_ip": "127.0.0.1",
        "rank_port": 40003,
        "registered_at": 0,
        "age_seconds": 0.0,
    }


async def test_a_contradiction_gets_400_naming_the_field_and_changes_nothing(
    directory: Directory,
) -> None:
    await directory.put_all([body(tp=(0, 2))])
    before = await directory.table()
    response = await directory.client.put("/route", json=body(tp=(1, 2), page_size=16))
    assert response.status_code == 400
    assert "page_size=16" in response.text
    policy = await directory.client.put(
        "/route", json=body(tp=(1, 2), decode_allocation_policy="late")
    )
    assert policy.status_code == 400
    assert policy.text.startswith("Inconsistent prefill allocation policies")
    assert await directory.table() == before
    assert directory.metric("globalkv_bootstrap_registrations_total", outcome="refused") == 2


BAD_BODIES: list[tuple[bytes, int, str]] = [
    (b"", 400, "not valid JSON"),
    (b"{", 400, "not valid JSON"),
    (b"\xff\xfe", 400, "not valid JSON"),
    (b"[" * 100_000, 400, "not valid JSON"),
    (b"[1, 2]", 422, "must be a JSON object, got list"),
    (b"null", 422, "must be a JSON object, got NoneType"),
    (json.dumps({**SGLANG_0_5_23_PUT, "attn_tp_rank": 5}).encode(), 422, "attn_tp_rank=5"),
    (json.dumps({**SGLANG_0_5_23_PUT, "rank_port": "x"}).encode(), 422, "rank_port"),
    (json.dumps({"rank_ip": "10.0.0.1"}).encode(), 422, "attn_tp_size: Field required"),
    (json.dumps({**SGLANG_0_5_23_PUT, "rank_ip": "http://h:1"}).encode(), 422, "rank_ip must be"),
    (json.dumps({**SGLANG_0_5_23_PUT, "rank_ip": "h\u0000"}).encode(), 422, "rank_ip must be"),
    (json.dumps({**SGLANG_0_5_23_PUT, "rank_ip": "999.9.9.9"}).encode(), 422, "rank_ip must be"),
    (
        json.dumps({**SGLANG_0_5_23_PUT, "dsv41_spec_layout": {"x": float("nan")}}).encode(),
        400,
        "NaN is not a JSON value",
    ),
]


@pytest.mark.parametrize(("raw", "status", "text"), BAD_BODIES)
async def test_malformed_registrations_get_4xx_and_change_nothing(
    directory: Directory, raw: bytes, status: int, text: str
) -> None:
    await directory.put_all([body(tp=(0, 2))])
    before = await directory.table()
    response = await directory.client.put("/route", content=raw)
    assert response.status_code == status
    assert text in response.text
    assert await directory.table() == before
    assert directory.metric("globalkv_bootstrap_registrations_total", outcome="invalid") == 1


async def test_an_oversized_body_gets_413(directory: Directory) -> None:
    response = await directory.client.put("/route", content=b" " * (MAX_BODY_BYTES + 1))
    assert response.status_code == 413
    assert (await directory.table())["registered"] == 0


async def test_a_client_leaving_mid_body_gets_400_not_500(directory: Directory) -> None:
    exchange = Exchange("PUT", "/route", [b'{"attn_tp_size": 2, '], complete=False)
    exchange.leave()
    await exchange.run(directory.app)
    assert exchange.status == 400
    assert b"left before sending the whole body" in exchange.body
    assert (await directory.table())["registered"] == 0


# ---- GET /route ------------------------------------------------------------------------


async def test_snapshot_is_503_until_every_coordinate_registered(directory: Directory) -> None:
    response = await directory.client.get(SNAPSHOT)
    assert (response.status_code, response.text) == (503, NOT_READY.format(0))
    await directory.put_all([body(tp=(0, 2)), body(tp=(0, 2))])
    response = await directory.client.get(SNAPSHOT)
    assert (response.status_code, response.text) == (503, NOT_READY.format(1))
    await directory.put_all([body(tp=(1, 2))])
    assert (await directory.client.get(SNAPSHOT)).status_code == 200


@pytest.mark.parametrize("version", COMPAT_VERSIONS)
async def test_snapshot_carries_exactly_the_compat_versions_keys(version: CompatVersion) -> None:
    env, client = await open_directory(sglang_compat=version)
    async with client:
        await env.put_all(instance(dp=2, tp=2, kv_layout="paged"))
        response = await client.get(SNAPSHOT)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json; charset=utf-8"
    snap = response.json()
    assert set(snap) == snapshot_keys(version, kv_layout=True)
    assert response.content == json.dumps(snap).encode()  # aiohttp's json.dumps bytes
    assert (snap["attn_tp_size"], snap["dp_size"], snap["follow_bootstrap_room"]) == (2, 2, True)


async def test_rank_lookup_answers_sglang_bytes(directory: Directory) -> None:
    await directory.put_all(instance(dp=2, tp=2, rank_ip="10.0.0.5"))
    response = await directory.client.get(rank_url(1, 0, 1, 0))
    assert response.status_code == 200
    assert response.content == b'{"rank_ip": "10.0.0.5", "rank_port": 41010}'
    assert response.headers["content-type"] == "application/json; charset=utf-8"


async def test_rank_lookup_is_503_before_ready_even_for_a_registered_rank(
    directory: Directory,
) -> None:
    await directory.put_all([body(tp=(0, 2))])
    response = await directory.client.get(rank_url(0, 0, 0, 0))
    assert (response.status_code, response.text) == (503, NOT_READY.format(1))


@pytest.mark.parametrize("coord", [(0, 0, 2, 0), (-1, -1, -1, 0), (0, 1, 0, 0), (5, 0, 0, 0)])
async def test_unknown_ranks_get_404_with_sglang_text(
    directory: Directory, coord: tuple[int, int, int, int]
) -> None:
    await directory.put_all(instance(tp=2))
    response = await directory.client.get(rank_url(*coord))
    dp, cp, tp, pp = coord
    assert response.status_code == 404
    assert response.text == (
        f"Bootstrap info not found for dp_rank={dp} cp_rank={cp} tp_rank={tp} pp_rank={pp}"
    )


@pytest.mark.parametrize(
    ("query", "names"),
    [
        ("", "prefill_dp_rank, prefill_cp_rank, target_tp_rank, target_pp_rank"),
        ("prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0", "target_pp_rank"),
        ("prefill_dp_rank=&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0", "prefill_dp_rank"),
    ],
)
async def test_missing_parameters_get_400(directory: Directory, query: str, names: str) -> None:
    await directory.put_all(instance())
    response = await directory.client.get(f"/route?{query}")
    assert response.status_code == 400
    assert response.text.startswith("Missing inputs for bootstrap server.")
    assert response.text.endswith(names)


@pytest.mark.parametrize("value", ["x", "1.0", "0x1", "1e3", "--1", "12345678901", " 1"])
async def test_non_integer_parameters_get_400_not_500(directory: Directory, value: str) -> None:
    await directory.put_all(instance())
    response = await directory.client.get(
        "/route",
        params={
            "prefill_dp_rank": 0,
            "prefill_cp_rank": value,
            "target_tp_rank": 0,
            "target_pp_rank": 0,
        },
    )
    assert response.status_code == 400
    assert "prefill_cp_rank=" in response.text
    assert (
        directory.metric(
            "globalkv_bootstrap_lookups_total", kind="malformed", outcome="bad_request"
        )
        == 1
    )


# ---- rooms -----------------------------------------------------------------------------


async def test_rooms_register_and_query_like_sglang(directory: Directory) -> None:
    room = 4611686018427387907
    ok = await directory.client.post(
        "/register_dp_rank", json={"bootstrap_room": room, "dp_rank": 1}
    )
    assert (ok.status_code, ok.text) == (200, "OK")
    response = await directory.client.post("/query_dp_ranks", json={"bootstrap_rooms": [room, 999]})
    assert response.status_code == 200
    assert response.content == b'{"4611686018427387907": 1}'
    empty = await directory.client.post("/query_dp_ranks", json={"bootstrap_rooms": []})
    assert empty.json() == {}


async def test_room_values_may_be_numeric_strings_and_latest_wins(directory: Directory) -> None:
    for dp in ("0", "1"):
        response = await directory.client.post(
            "/register_dp_rank", json={"bootstrap_room": "77", "dp_rank": dp}
        )
        assert response.status_code == 200
    response = await directory.client.post("/query_dp_ranks", json={"bootstrap_rooms": ["77"]})
    assert response.json() == {"77": 1}


async def test_rooms_expire_after_the_ttl() -> None:
    env, client = await open_directory(room_ttl=10)
    async with client:
        await client.post("/register_dp_rank", json={"bootstrap_room": 5, "dp_rank": 1})
        env.clock.advance(10)
        response = await client.post("/query_dp_ranks", json={"bootstrap_rooms": [5]})
        assert response.json() == {}
        assert (await env.table())["rooms"] == 0
    assert env.metric("globalkv_bootstrap_room_expirations_total") == 1


async def test_the_room_cap_evicts_oldest_and_counts_evictions() -> None:
    env, client = await open_directory(max_rooms=2)
    async with client:
        for room in (1, 2, 3):
            await client.post("/register_dp_rank", json={"bootstrap_room": room, "dp_rank": 0})
            env.clock.advance(1)
        response = await client.post("/query_dp_ranks", json={"bootstrap_rooms": [1, 2, 3]})
        assert response.json() == {"2": 0, "3": 0}
    assert env.metric("globalkv_bootstrap_room_evictions_total") == 1
    assert env.metric("globalkv_bootstrap_room_entries") == 2


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        ("/register_dp_rank", b"{"),
        ("/register_dp_rank", b'{"bootstrap_room": -5, "dp_rank": 0}'),
        ("/register_dp_rank", b'{"bootstrap_room": "abc", "dp_rank": 0}'),
        ("/register_dp_rank", b'{"dp_rank": 0}'),
        ("/register_dp_rank", b"[]"),
        ("/query_dp_ranks", b'{"bootstrap_rooms": "5"}'),
        ("/query_dp_ranks", b'{"bootstrap_rooms": [1, "x"]}'),
        ("/query_dp_ranks", b'{"rooms": [1]}'),
        ("/query_dp_ranks", b"5"),
    ],
)
async def test_malformed_room_bodies_get_4xx_and_change_nothing(
    directory: Directory, path: str, raw: bytes
) -> None:
    await directory.client.post("/register_dp_rank", json={"bootstrap_room": 9, "dp_rank": 1})
    response = await directory.client.post(path, content=raw)
    assert response.status_code in (400, 422)
    assert path.strip("/") in response.text
    query = await directory.client.post("/query_dp_ranks", json={"bootstrap_rooms": [9, 5]})
    assert query.json() == {"9": 1}
    endpoint = path.strip("/")
    assert (
        directory.metric(
            "globalkv_bootstrap_room_requests_total", endpoint=endpoint, outcome="invalid"
        )
        == 1
    )
