"""KV events of a real prefill process, decoded with globalkv.wire, for every flavour."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from globalkv.wire import FLAVORS, AllBlocksCleared, BlockRemoved, BlockStored
from tests.enginesim.cluster import EngineProc, EventTap, engines, pd_body, pd_request

pytestmark = pytest.mark.integration


def generate(engine: EngineProc, input_ids: list[int], **fields: Any) -> dict[str, Any]:
    """A prefill-only request (no output tokens), so it publishes exactly one batch."""
    body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": 0}, **fields}
    answer = httpx.post(f"{engine.url}/generate", json=body, timeout=10)
    assert answer.status_code == 200, answer.text
    result: dict[str, Any] = answer.json()
    return result


def probe(engine: EngineProc, **fields: Any) -> Callable[[int], None]:
    """Requests that each store pages nobody else uses, so each publishes a batch."""

    def poke(attempt: int) -> None:
        generate(engine, [90_000 + attempt] * 8, **fields)

    return poke


@pytest.fixture
def taps() -> Iterator[list[EventTap]]:
    opened: list[EventTap] = []
    yield opened
    for tap in opened:
        tap.close()


def open_tap(taps: list[EventTap], engine: EngineProc, dp_rank: int = 0) -> EventTap:
    tap = EventTap(engine, dp_rank)
    taps.append(tap)
    return tap


@pytest.mark.parametrize("flavor", FLAVORS)
def test_stores_decode_with_wire_for_every_flavor(taps: list[EventTap], flavor: str) -> None:
    with engines(("prefill", ["--page-size", "4", "--kv-events-format", flavor])) as (prefill,):
        assert prefill.info["kv_events"]["format"] == flavor
        tap = open_tap(taps, prefill)
        start = tap.until_live(probe(prefill))
        prompt = list(range(100, 111))
        generate(prefill, prompt)
        seq, batch = tap.next()
        assert (seq, batch.dp_rank) == (start + 1, 0)
        [stored] = batch.events
        assert isinstance(stored, BlockStored)
        assert list(stored.token_ids) == prompt[:8]
        assert (stored.block_size, stored.parent_block_hash) == (4, None)
        assert len(stored.block_hashes) == 2

        generate(prefill, [*prompt[:8], 7, 7, 7, 7, 9])
        _, batch = tap.next()
        [extension] = batch.events
        assert isinstance(extension, BlockStored)
        assert extension.parent_block_hash == stored.block_hashes[1]
        assert list(extension.token_ids) == [7, 7, 7, 7]


def test_evictions_emit_removes_of_stored_blocks(taps: list[EventTap]) -> None:
    with engines(("prefill", ["--page-size", "2", "--kv-capacity", "4"])) as (prefill,):
        tap = open_tap(taps, prefill)
        tap.until_live(probe(prefill))
        assert httpx.post(f"{prefill.url}/flush_cache", timeout=10).status_code == 200
        assert list(tap.next()[1].events) == [AllBlocksCleared()]
        stored: set[int] = set()
        removed: list[int] = []
        for first in range(10):
            generate(prefill, [first, first, 5, 5, 0])
            _, batch = tap.next()
            for event in batch.events:
                if isinstance(event, BlockStored):
                    stored.update(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    removed.extend(event.block_hashes)
        assert len(removed) >= 10
        assert set(removed) <= stored
        assert len(removed) == len(set(removed))
        assert prefill.metric("globalkv_engine_kv_cache_pages", {"dp_rank": "0"}) == 4
        evictions = prefill.metric("globalkv_engine_kv_cache_evictions_total", {"dp_rank": "0"})
        assert evictions >= len(removed)


def live_until(tap: EventTap, engine: EngineProc, end: int) -> set[int]:
    """The live seqs below `end`, known complete once a batch at or past `end` arrived
    (a PUB delivers in order); each poke publishes one more batch."""
    seen: set[int] = set()
    for attempt in range(100):
        while tap.sub.poll(0):
            seen.add(tap.next()[0])
        if seen and max(seen) >= end:
            return {seq for seq in seen if seq < end}
        probe(engine)(1000 + attempt)
        if tap.sub.poll(2000):
            seen.add(tap.next()[0])
    raise TimeoutError(f"no live batch reached seq {end}")


def test_replay_returns_exactly_the_batches_dropped_on_the_live_stream(
    taps: list[EventTap],
) -> None:
    args = ["--page-size", "2", "--fault-drop-event-rate", "0.5", "--fault-seed", "7"]
    with engines(("prefill", args)) as (prefill,):
        tap = open_tap(taps, prefill)
        first = tap.until_live(probe(prefill)) + 1
        for i in range(12):
            generate(prefill, [1000 + i, 1, 1])
        end = tap.published()
        assert end == first + 12
        live = live_until(tap, prefill, end)
        dropped = set(range(first, end)) - live
        assert dropped, "the seeded fault dropped nothing"
        assert live & set(range(first, end)), "the seeded fault dropped everything"

        replayed = dict(tap.replay(first))
        assert set(replayed) >= set(range(first, end))
        for i in range(12):
            [event] = replayed[first + i].events
            assert isinstance(event, BlockStored)
            assert list(event.token_ids) == [1000 + i, 1]
        faults = prefill.metric(
            "globalkv_engine_kv_event_batches_total", {"dp_rank": "0", "outcome": "dropped_fault"}
        )
        assert faults >= len(dropped)


def test_restart_resets_seq_and_emits_a_clear(taps: list[EventTap]) -> None:
    with engines(("prefill", ["--page-size", "2"])) as (prefill,):
        tap = open_tap(taps, prefill)
        tap.until_live(probe(prefill))
        generate(prefill, [5, 6, 7, 8, 9])
        tap.next()
        answer = httpx.post(f"{prefill.url}/_sim/restart", timeout=10)
        assert answer.status_code == 200
        [rank] = answer.json()["kv_cache"]
        assert (rank["pages"], rank["next_event_seq"]) == (0, 1)
        seq, batch = tap.next()
        assert (seq, list(batch.events)) == (0, [AllBlocksCleared()])
        assert [seq for seq, _ in tap.replay(0)] == [0]
        assert generate(prefill, [5, 6, 7, 8, 9])["meta_info"]["cached_tokens"] == 0
        seq, batch = tap.next()
        assert seq == 1
        assert isinstance(batch.events[0], BlockStored)


async def test_dp_ranks_publish_on_port_plus_rank_and_follow_the_room(
    taps: list[EventTap],
) -> None:
    with engines(("prefill", ["--dp", "2", "--page-size", "2"]), ("decode", [])) as (
        prefill,
        decode,
    ):
        assert prefill.info["kv_events"]["dp_size"] == 2
        rank_taps = [open_tap(taps, prefill, rank) for rank in (0, 1)]
        for rank, tap in enumerate(rank_taps):
            tap.until_live(probe(prefill, routed_dp_rank=rank))
        for room in (10, 11):
            body = pd_body(
                prefill, room, input_ids=[room, 2, 2, 2], sampling_params={"max_new_tokens": 1}
            )
            _, answer = await pd_request(prefill, decode, "/generate", body)
            assert answer.status_code == 200, answer.text
            assert answer.json()["meta_info"]["prefill_dp_rank"] == room % 2
            _, batch = rank_taps[room % 2].next()
            assert batch.dp_rank == room % 2
            [stored] = batch.events
            assert isinstance(stored, BlockStored)
            assert list(stored.token_ids) == [room, 2, 2, 2]
