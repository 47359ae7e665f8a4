from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from bootstrap.protocol import (
    COMPAT_VERSIONS,
    MAX_QUERY_ROOMS,
    SNAPSHOT_FIELDS,
    CompatVersion,
    Coordinate,
    RankAddress,
    RankRegistration,
    RoomQuery,
    RoomRegistration,
    Topology,
    snapshot_keys,
)
from kvplumbing.validation import validation_message
from tests.bootstrap.factories import SGLANG_0_5_23_PUT, SGLANG_0_5_23_SNAPSHOT, body

REQUIRED = [
    "attn_tp_size",
    "attn_tp_rank",
    "attn_cp_size",
    "attn_cp_rank",
    "attn_dp_size",
    "attn_dp_rank",
    "pp_size",
    "pp_rank",
    "system_dp_size",
    "system_dp_rank",
    "rank_ip",
    "rank_port",
    "page_size",
    "kv_cache_dtype",
]


def test_compat_versions_are_the_three_supported() -> None:
    assert COMPAT_VERSIONS == ("0.5.10", "0.5.16", "0.5.23")
    assert set(SNAPSHOT_FIELDS) == set(COMPAT_VERSIONS)


def test_sglang_0_5_23_body_parses_field_by_field() -> None:
    reg = RankRegistration.model_validate(SGLANG_0_5_23_PUT)
    for name, value in SGLANG_0_5_23_PUT.items():
        assert getattr(reg, name) == value, name
    assert reg.coordinate == Coordinate(1, 0, 1, 0)
    assert reg.address == RankAddress(rank_ip="127.0.0.1", rank_port=40003)


def test_optional_fields_take_sglang_defaults_and_unknown_keys_are_ignored() -> None:
    minimal = {k: SGLANG_0_5_23_PUT[k] for k in REQUIRED}
    reg = RankRegistration.model_validate({**minimal, "some_future_field": [1, 2]})
    assert reg.kv_layout is None
    assert reg.dsv41_spec_layout is None
    assert reg.load_balance_method == "follow_bootstrap_room"
    assert reg.enable_dsa_cache_layer_split is False
    assert reg.enable_kv_cache_sharding is False
    assert reg.prefill_http_port is None
    assert reg.decode_allocation_policy == "early"
    assert not hasattr(reg, "some_future_field")


@pytest.mark.parametrize("field", ["rank_port", "page_size", "prefill_http_port"])
def test_numeric_strings_are_coerced_where_sglang_calls_int(field: str) -> None:
    reg = RankRegistration.model_validate({**SGLANG_0_5_23_PUT, field: " 4242 "})
    assert getattr(reg, field) == 4242


def test_kv_cache_dtype_may_be_null_but_must_be_present() -> None:
    assert RankRegistration.model_validate({**SGLANG_0_5_23_PUT, "kv_cache_dtype": None})
    without = {k: v for k, v in SGLANG_0_5_23_PUT.items() if k != "kv_cache_dtype"}
    with pytest.raises(ValidationError, match="kv_cache_dtype"):
        RankRegistration.model_validate(without)


def test_system_dp_replaces_attention_dp_as_the_row() -> None:
    reg = RankRegistration.model_validate(
        body(dp=(0, 1), system_dp_size=4, system_dp_rank=3, attn_dp_size=2, attn_dp_rank=1)
    )
    assert (reg.dp_size, reg.dp_rank) == (4, 3)
    plain = RankRegistration.model_validate(body(dp=(1, 2)))
    assert (plain.dp_size, plain.dp_rank) == (2, 1)


@pytest.mark.parametrize("field", REQUIRED)
def test_each_required_field_is_named_when_missing(field: str) -> None:
    data = {k: v for k, v in SGLANG_0_5_23_PUT.items() if k != field}
    with pytest.raises(ValidationError) as info:
        RankRegistration.model_validate(data)
    assert validation_message(info.value).startswith(f"{field}: Field required")


BAD_VALUES: list[tuple[str, Any]] = [
    ("attn_tp_size", "2"),  # SGLang would multiply a string: strict ints only
    ("attn_tp_size", 2.0),
    ("attn_tp_size", True),
    ("attn_tp_size", 0),
    ("attn_tp_size", -1),
    ("attn_tp_rank", 2),  # equal to the size
    ("attn_tp_rank", -1),
    ("attn_dp_rank", 5),
    ("pp_rank", 1),
    ("system_dp_rank", 1),
    ("rank_port", 0),
    ("rank_port", 65536),
    ("rank_port", "40003abc"),
    ("rank_port", "1" * 30),
    ("rank_port", None),
    ("rank_ip", ""),
    ("rank_ip", "10.0.0.1 10.0.0.2"),
    ("rank_ip", "http://10.0.0.1:8998"),
    ("rank_ip", "10.0.0.1\x00"),
    ("rank_ip", "999.999.999.999"),
    ("rank_ip", "fe80::1%eth0"),
    ("rank_ip", "-prefill"),
    ("rank_ip", 10),
    ("page_size", 0),
    ("kv_cache_dtype", 16),
    ("enable_kv_cache_sharding", "false"),  # SGLang's bool("false") is True
    ("enable_dsa_cache_layer_split", 1),
    ("prefill_http_port", 0),
    ("decode_allocation_policy", None),
    ("dsv41_spec_layout", "layout"),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_bad_values_are_refused_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValidationError) as info:
        RankRegistration.model_validate({**SGLANG_0_5_23_PUT, field: value})
    assert field in validation_message(info.value)


def test_a_world_larger_than_the_limit_is_refused() -> None:
    with pytest.raises(ValidationError, match="exceeds the limit"):
        RankRegistration.model_validate(body(tp=(0, 4096), pp=(0, 64)))


@pytest.mark.parametrize("version", COMPAT_VERSIONS)
def test_snapshot_has_exactly_the_versions_keys(version: CompatVersion) -> None:
    topology = Topology.from_registration(RankRegistration.model_validate(SGLANG_0_5_23_PUT))
    snap = topology.snapshot(version)
    assert set(snap) == snapshot_keys(version)
    assert list(snap) == [k for k in SNAPSHOT_FIELDS[version] if k in snap]


def test_snapshot_key_sets_per_version_are_pinned() -> None:
    base = {
        "attn_tp_size",
        "attn_cp_size",
        "dp_size",
        "pp_size",
        "page_size",
        "kv_cache_dtype",
        "follow_bootstrap_room",
        "target_tp_rank",
        "target_tp_ranks",
        "target_cp_ranks",
        "target_pp_ranks",
        "required_dst_info_num",
        "required_prefill_response_num",
    }
    v16 = base | {"enable_dsa_cache_layer_split", "prefill_http_port"}
    v23 = v16 | {"decode_allocation_policy", "enable_kv_cache_sharding"}
    assert snapshot_keys("0.5.10") == base
    assert snapshot_keys("0.5.16") == v16
    assert snapshot_keys("0.5.23") == v23
    assert snapshot_keys("0.5.23", kv_layout=True, dsv41=True) == v23 | {
        "kv_layout",
        "dsv41_spec_layout",
    }


def test_0_5_23_snapshot_renders_like_sglang_byte_for_byte() -> None:
    topology = Topology.from_registration(RankRegistration.model_validate(SGLANG_0_5_23_PUT))
    assert json.dumps(topology.snapshot("0.5.23")) == SGLANG_0_5_23_SNAPSHOT


def test_optional_layouts_appear_only_when_set_and_only_for_0_5_23() -> None:
    layout = {"block": 64}
    reg = RankRegistration.model_validate(
        {**SGLANG_0_5_23_PUT, "kv_layout": "paged", "dsv41_spec_layout": layout}
    )
    topology = Topology.from_registration(reg)
    snap = topology.snapshot("0.5.23")
    assert (snap["kv_layout"], snap["dsv41_spec_layout"]) == ("paged", layout)
    assert list(snap)[7:10] == ["enable_dsa_cache_layer_split", "dsv41_spec_layout", "kv_layout"]
    older: tuple[CompatVersion, ...] = ("0.5.10", "0.5.16")
    for version in older:
        assert "kv_layout" not in topology.snapshot(version)


def test_follow_bootstrap_room_comes_from_load_balance_method() -> None:
    reg = RankRegistration.model_validate(
        {**SGLANG_0_5_23_PUT, "load_balance_method": "round_robin"}
    )
    assert Topology.from_registration(reg).follow_bootstrap_room is False


@pytest.mark.parametrize("version", COMPAT_VERSIONS)
def test_a_snapshot_of_any_version_parses_back(version: CompatVersion) -> None:
    topology = Topology.from_registration(RankRegistration.model_validate(SGLANG_0_5_23_PUT))
    parsed = Topology.model_validate(topology.snapshot(version))
    assert (parsed.attn_tp_size, parsed.dp_size, parsed.page_size) == (2, 2, 64)
    assert parsed.expected == 4
    if version != "0.5.10":
        assert parsed.prefill_http_port == 30000


def test_topology_lists_every_coordinate_once() -> None:
    topology = Topology.from_registration(
        RankRegistration.model_validate(body(dp=(0, 2), cp=(0, 1), tp=(0, 2), pp=(0, 3)))
    )
    coords = topology.coordinates()
    assert len(coords) == len(set(coords)) == topology.expected == 12


def test_room_bodies_accept_numeric_strings() -> None:
    entry = RoomRegistration.model_validate(
        {"bootstrap_room": "4611686018427387907", "dp_rank": "1"}
    )
    assert (entry.bootstrap_room, entry.dp_rank) == (4611686018427387907, 1)
    query = RoomQuery.model_validate({"bootstrap_rooms": [1, "2", 2**64 - 1]})
    assert query.bootstrap_rooms == [1, 2, 2**64 - 1]


@pytest.mark.parametrize(
    "data",
    [
        {"bootstrap_room": -1, "dp_rank": 0},
        {"bootstrap_room": 2**64, "dp_rank": 0},
        {"bootstrap_room": "x", "dp_rank": 0},
        {"bootstrap_room": 1.5, "dp_rank": 0},
        {"bootstrap_room": 1, "dp_rank": -1},
        {"bootstrap_room": 1, "dp_rank": True},
        {"bootstrap_room": 1},
        {"dp_rank": 1},
    ],
)
def test_bad_room_registrations_are_refused(data: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        RoomRegistration.model_validate(data)


def test_room_queries_are_bounded() -> None:
    with pytest.raises(ValidationError, match="bootstrap_rooms"):
        RoomQuery.model_validate({"bootstrap_rooms": list(range(MAX_QUERY_ROOMS + 1))})
    with pytest.raises(ValidationError, match="bootstrap_rooms"):
        RoomQuery.model_validate({"bootstrap_rooms": "1,2"})


@pytest.mark.parametrize(
    "rank_ip", ["10.0.0.5", "::1", "[fd00::5]", "prefill-0.prefill.default.svc", "node7"]
)
def test_hosts_a_rank_may_register(rank_ip: str) -> None:
    reg = RankRegistration.model_validate({**SGLANG_0_5_23_PUT, "rank_ip": rank_ip})
    assert reg.address.rank_ip == rank_ip
