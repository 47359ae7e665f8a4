from __future__ import annotations

from typing import Any

import pytest

from bootstrap.protocol import Coordinate, RankAddress, RankRegistration
from bootstrap.table import Directory, RegistrationRefused, RoomTable
from tests.bootstrap.factories import body, instance, registration
from tests.support.clock import FakeClock


def fill(directory: Directory, bodies: list[dict[str, Any]]) -> None:
    for data in bodies:
        directory.register(RankRegistration.model_validate(data))


def state(directory: Directory) -> tuple[object, ...]:
    return (directory.topology, directory.entries(), directory.accepted, directory.ready)


def test_empty_directory_knows_nothing() -> None:
    directory = Directory()
    assert (directory.topology, directory.expected, directory.registered) == (None, None, 0)
    assert not directory.ready
    assert directory.missing() == []
    assert directory.lookup(Coordinate(0, 0, 0, 0)) is None


def test_ready_exactly_when_every_distinct_coordinate_is_registered() -> None:
    directory = Directory()
    first = directory.register(registration(tp=(0, 2), dp=(0, 2)))
    assert (first.registered, first.expected, first.became_ready) == (1, 4, False)
    assert directory.missing() == [(0, 0, 1, 0), (1, 0, 0, 0), (1, 0, 1, 0)]
    outcomes = [
        directory.register(RankRegistration.model_validate(b)) for b in instance(dp=2, tp=2)
    ]
    assert directory.ready
    assert [o.became_ready for o in outcomes] == [False, False, False, True]
    assert directory.missing() == []


def test_a_duplicate_registration_does_not_make_it_ready() -> None:
    """SGLang counts PUTs: 2 PUTs of tp0 would make a tp=2 instance "ready"."""
    directory = Directory()
    directory.register(registration(tp=(0, 2)))
    outcome = directory.register(registration(tp=(0, 2)))
    assert directory.accepted == 2
    assert directory.registered == 1
    assert not directory.ready
    assert not outcome.became_ready
    assert directory.missing() == [Coordinate(0, 0, 1, 0)]


def test_re_registration_overwrites_the_endpoint_and_its_time() -> None:
    clock = FakeClock()
    directory = Directory(clock)
    directory.register(registration(port=5000))
    clock.advance(7.5)
    outcome = directory.register(registration(port=6000, rank_ip="10.9.9.9"))
    assert outcome.previous == RankAddress(rank_ip="127.0.0.1", rank_port=5000)
    assert directory.lookup(Coordinate(0, 0, 0, 0)) == RankAddress(
        rank_ip="10.9.9.9", rank_port=6000
    )
    [entry] = directory.entries()
    assert entry.registered_at == clock.now
    assert outcome.became_ready is False  # was ready already


def test_registration_times_come_from_the_clock() -> None:
    clock = FakeClock(50.0)
    directory = Directory(clock)
    for data in instance(tp=3):
        directory.register(RankRegistration.model_validate(data))
        clock.advance(1.0)
    assert [e.registered_at for e in directory.entries()] == [50.0, 51.0, 52.0]


def test_system_dp_rank_is_the_row_key() -> None:
    directory = Directory()
    for rank in range(2):
        directory.register(
            registration(port=7000 + rank, system_dp_size=2, system_dp_rank=rank, dp=(0, 1))
        )
    assert directory.ready
    assert directory.lookup(Coordinate(1, 0, 0, 0)) == RankAddress(
        rank_ip="127.0.0.1", rank_port=7001
    )


CONTRADICTIONS: list[tuple[dict[str, Any], str, str]] = [
    ({"decode_allocation_policy": "late"}, "decode_allocation_policy", "allocation policies"),
    ({"dsv41_spec_layout": {"block": 1}}, "dsv41_spec_layout", "DSpark PD layout"),
    ({"tp": (0, 4)}, "attn_tp_size", "attn_tp_size=4"),
    ({"cp": (0, 2)}, "attn_cp_size", "attn_cp_size=2"),
    ({"pp": (0, 2)}, "pp_size", "pp_size=2"),
    ({"dp": (0, 4)}, "attn_dp_size", "dp_size=4"),
    ({"system_dp_size": 4, "system_dp_rank": 0}, "system_dp_size", "dp_size=4"),
    ({"page_size": 16}, "page_size", "page_size=16"),
    ({"kv_cache_dtype": "fp8_e4m3"}, "kv_cache_dtype", "fp8_e4m3"),
    ({"kv_layout": "nhd"}, "kv_layout", "nhd"),
    ({"load_balance_method": "round_robin"}, "load_balance_method", "round_robin"),
    ({"enable_dsa_cache_layer_split": True}, "enable_dsa_cache_layer_split", "True"),
    ({"enable_kv_cache_sharding": True}, "enable_kv_cache_sharding", "True"),
    ({"prefill_http_port": 31000}, "prefill_http_port", "31000"),
]


@pytest.mark.parametrize(("change", "field", "text"), CONTRADICTIONS)
def test_contradictions_are_refused_naming_the_field_and_change_nothing(
    change: dict[str, Any], field: str, text: str
) -> None:
    directory = Directory()
    directory.register(registration(dp=(0, 2), tp=(0, 2)))
    before = state(directory)
    kwargs: dict[str, Any] = {"dp": (1, 2), "tp": (1, 2), **change}
    with pytest.raises(RegistrationRefused) as info:
        directory.register(RankRegistration.model_validate(body(**kwargs)))
    assert info.value.field == field
    assert text in info.value.message
    assert state(directory) == before


def test_a_registration_agreeing_with_the_topology_is_accepted_after_a_refusal() -> None:
    directory = Directory()
    directory.register(registration(tp=(0, 2)))
    with pytest.raises(RegistrationRefused):
        directory.register(registration(tp=(1, 2), page_size=32))
    directory.register(registration(tp=(1, 2)))
    assert directory.ready


def test_reset_forgets_topology_and_ranks_so_the_next_registration_fixes_a_new_one() -> None:
    directory = Directory()
    fill(directory, instance(tp=2))
    assert directory.reset() == 2
    assert (directory.topology, directory.registered, directory.accepted) == (None, 0, 0)
    assert not directory.ready
    outcomes = [directory.register(registration(tp=(t, 4), page_size=16)) for t in range(4)]
    assert [o.became_ready for o in outcomes] == [False, False, False, True]
    assert directory.topology is not None
    assert (directory.topology.attn_tp_size, directory.topology.page_size) == (4, 16)


# ---- rooms ------------------------------------------------------------------------------


def test_latest_room_registration_wins() -> None:
    rooms = RoomTable(ttl=10, max_entries=10, clock=FakeClock())
    rooms.put(7, 0)
    rooms.put(7, 1)
    assert rooms.get(7) == 1
    assert len(rooms) == 1


def test_rooms_live_exactly_the_ttl() -> None:
    clock = FakeClock()
    rooms = RoomTable(ttl=120, max_entries=10, clock=clock)
    rooms.put(1, 0)
    clock.advance(60)
    rooms.put(2, 1)
    clock.advance(59.999)
    assert rooms.query([1, 2]) == {1: 0, 2: 1}
    clock.advance(0.001)
    assert rooms.query([1, 2]) == {2: 1}
    assert (len(rooms), rooms.expired) == (1, 1)
    clock.advance(60)
    rooms.expire()
    assert (len(rooms), rooms.expired, rooms.evicted) == (0, 2, 0)


def test_re_registering_a_room_renews_its_ttl() -> None:
    clock = FakeClock()
    rooms = RoomTable(ttl=10, max_entries=10, clock=clock)
    rooms.put(1, 0)
    clock.advance(9)
    rooms.put(1, 0)
    clock.advance(9)
    assert rooms.get(1) == 0


def test_the_cap_evicts_the_oldest_registrations_first_and_counts_them() -> None:
    clock = FakeClock()
    rooms = RoomTable(ttl=1000, max_entries=3, clock=clock)
    for room in (1, 2, 3):
        rooms.put(room, room % 2)
        clock.advance(1)
    rooms.put(1, 1)  # renewed: now the youngest
    rooms.put(4, 0)
    rooms.put(5, 0)
    assert rooms.query(range(10)) == {1: 1, 4: 0, 5: 0}
    assert (len(rooms), rooms.evicted, rooms.expired) == (3, 2, 0)


def test_clear_drops_every_room_without_counting_expiry_or_eviction() -> None:
    rooms = RoomTable(ttl=10, max_entries=10, clock=FakeClock())
    rooms.put(1, 0)
    rooms.put(2, 1)
    assert rooms.clear() == 2
    assert (len(rooms), rooms.get(1), rooms.expired, rooms.evicted) == (0, None, 0, 0)


def test_unknown_rooms_are_left_out_of_answers() -> None:
    rooms = RoomTable(ttl=10, max_entries=10, clock=FakeClock())
    assert rooms.query([]) == {}
    rooms.put(5, 1)
    assert rooms.query([4, 5, 6]) == {5: 1}
    assert rooms.get(4) is None


@pytest.mark.parametrize(("ttl", "cap"), [(0, 1), (-1, 1), (1, 0)])
def test_room_table_bounds_must_be_positive(ttl: float, cap: int) -> None:
    with pytest.raises(ValueError, match="must be"):
        RoomTable(ttl=ttl, max_entries=cap)
