"""Our own paths beside SGLang's: the whole-table view, its reset, metrics and logs."""

from __future__ import annotations

import logging

import pytest

from tests.bootstrap.factories import body, instance
from tests.bootstrap.served import NOT_READY, SNAPSHOT, Directory, open_directory, rank_url


async def test_directory_view_reports_topology_missing_and_times(directory: Directory) -> None:
    view = await directory.table()
    assert view == {
        "ready": False,
        "sglang_compat": "0.5.23",
        "topology": None,
        "expected": None,
        "registered": 0,
        "missing": [],
        "ranks": [],
        "registrations_accepted": 0,
        "rooms": 0,
    }
    await directory.put_all([body(tp=(1, 2), pp=(1, 2))])
    directory.clock.advance(2.5)
    await directory.put_all([body(tp=(1, 2), pp=(1, 2))])
    view = await directory.table()
    assert view["topology"]["attn_tp_size"] == 2
    assert view["topology"]["pp_size"] == 2
    assert (view["expected"], view["registered"], view["registrations_accepted"]) == (4, 1, 2)
    assert view["missing"] == [[0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0]]
    assert view["ranks"][0]["registered_at"] == directory.clock.now


async def test_metrics_count_registrations_lookups_and_rooms(directory: Directory) -> None:
    await directory.client.get(SNAPSHOT)
    await directory.put_all(instance(tp=2))
    await directory.put_all(instance(tp=2))
    await directory.put_all([body(tp=(0, 2), port=1234)])
    await directory.client.get(SNAPSHOT)
    await directory.client.get(rank_url(0, 0, 1, 0))
    await directory.client.get(rank_url(0, 0, 9, 0))
    await directory.client.post("/query_dp_ranks", json={"bootstrap_rooms": [1, 2]})
    response = await directory.client.get("/metrics")
    assert response.status_code == 200
    assert "globalkv_bootstrap_ready 1.0" in response.text
    m = directory.metric
    assert m("globalkv_bootstrap_registrations_total", outcome="new") == 2
    assert m("globalkv_bootstrap_registrations_total", outcome="refreshed") == 2
    assert m("globalkv_bootstrap_registrations_total", outcome="moved") == 1
    assert m("globalkv_bootstrap_lookups_total", kind="snapshot", outcome="not_ready") == 1
    assert m("globalkv_bootstrap_lookups_total", kind="snapshot", outcome="ok") == 1
    assert m("globalkv_bootstrap_lookups_total", kind="rank", outcome="ok") == 1
    assert m("globalkv_bootstrap_lookups_total", kind="rank", outcome="not_found") == 1
    assert m("globalkv_bootstrap_rooms_queried_total", result="unknown") == 2
    assert (m("globalkv_bootstrap_registered_ranks"), m("globalkv_bootstrap_expected_ranks")) == (
        2,
        2,
    )


async def test_logs_one_line_per_registration_and_one_when_ready(
    directory: Directory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="bootstrap.server")
    await directory.put_all(instance(tp=2))
    await directory.put_all(instance(tp=2))  # refreshes log at DEBUG
    await directory.put_all([body(tp=(0, 2), port=1234)])
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "registered DP0 CP0 TP0 PP0 at 127.0.0.1:40000 (1/2 coordinates)",
        "registered DP0 CP0 TP1 PP0 at 127.0.0.1:40010 (2/2 coordinates)",
        "directory ready: all 2 coordinates registered",
        "re-registered DP0 CP0 TP0 PP0 at 127.0.0.1:1234, was 127.0.0.1:40000 (2/2 coordinates)",
    ]


async def test_each_app_owns_its_metrics_registry() -> None:
    first, c1 = await open_directory()
    second, c2 = await open_directory()
    async with c1, c2:
        await first.put_all(instance())
    assert first.metric("globalkv_bootstrap_registrations_total", outcome="new") == 1
    assert second.metric("globalkv_bootstrap_registrations_total", outcome="new") == 0


async def test_delete_empties_the_table_so_a_new_topology_can_register(
    directory: Directory, caplog: pytest.LogCaptureFixture
) -> None:
    await directory.put_all(instance(tp=2))
    await directory.client.post("/register_dp_rank", json={"bootstrap_room": 9, "dp_rank": 0})
    caplog.set_level(logging.WARNING, logger="bootstrap.server")
    response = await directory.client.delete("/v1/directory")
    assert response.status_code == 200
    assert response.json() == {"dropped_ranks": 2, "dropped_rooms": 1}
    assert [r.getMessage() for r in caplog.records] == [
        "directory reset by 127.0.0.1: dropped 2 ranks and 1 room entries"
    ]
    view = await directory.table()
    assert (view["ready"], view["topology"], view["ranks"], view["rooms"]) == (False, None, [], 0)
    assert view["registrations_accepted"] == 0
    snapshot = await directory.client.get(SNAPSHOT)
    assert (snapshot.status_code, snapshot.text) == (503, NOT_READY.format(0))
    await directory.put_all(instance(tp=4, page_size=16))
    view = await directory.table()
    assert (view["ready"], view["topology"]["attn_tp_size"], view["topology"]["page_size"]) == (
        True,
        4,
        16,
    )
    assert directory.metric("globalkv_bootstrap_ready") == 1
    assert directory.metric("globalkv_bootstrap_expected_ranks") == 4


async def test_delete_of_an_empty_directory_drops_nothing(directory: Directory) -> None:
    response = await directory.client.delete("/v1/directory")
    assert response.json() == {"dropped_ranks": 0, "dropped_rooms": 0}
    assert (await directory.table())["topology"] is None
