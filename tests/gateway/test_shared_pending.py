"""The other replicas' pending prompts as heard, per origin (no Redis: changes applied
directly)."""

from __future__ import annotations

from gateway.replicas.shared_pending import ORIGIN_MAX_KEYS, RemotePending
from gateway.replicas.shared_wire import MAX_KEYS_PER_ADD, Add, Done, parse_change


def test_an_add_delivered_twice_leaves_nothing_once_done() -> None:
    """redis-py retries a PUBLISH whose reply was lost, so the same changes can come twice:
    the first entry, overwritten, would have stayed in the table for good."""
    remote = RemotePending(0.0)
    remote.apply("gw-a", Add(0, "p0", [11, 12], None), now=1.0)
    remote.apply("gw-a", Add(0, "p0", [11, 12], None), now=1.0)
    assert remote.table.keys == 2
    remote.apply("gw-a", Done(0, computed=False), now=2.0)
    assert remote.table.keys == 0
    assert not remote.depths([11, 12], now=2.0)


def test_one_origin_cannot_fill_the_table_the_others_share() -> None:
    remote = RemotePending(0.0)
    for serial in range(ORIGIN_MAX_KEYS // MAX_KEYS_PER_ADD + 5):
        start = 10**9 + serial * MAX_KEYS_PER_ADD
        remote.apply(
            "gw-x", Add(serial, "p9", list(range(start, start + MAX_KEYS_PER_ADD)), None), 1.0
        )
    assert remote.table.keys == ORIGIN_MAX_KEYS
    remote.apply("gw-a", Add(0, "p0", [11, 12], None), now=1.0)
    assert remote.depths([11, 12], now=1.0)["p0"].blocks == 2
    remote.apply("gw-x", Done(0, computed=True), now=1.0)  # room again for gw-x
    remote.apply("gw-x", Add(10**6, "p9", [5, 6], None), now=1.0)
    assert remote.depths([5, 6], now=1.0)["p9"].blocks == 2


def test_one_add_is_counted_for_its_first_blocks_only() -> None:
    change = parse_change(["add", 0, "p9", list(range(1_000_000)), None])
    assert isinstance(change, Add)
    assert change.keys == list(range(MAX_KEYS_PER_ADD))


def test_a_replica_that_left_takes_its_pending_prompts_with_it() -> None:
    """It will never send the "done" of a prompt pending when it died."""
    remote = RemotePending(2.0)
    remote.apply("gw-a", Add(0, "p0", [11, 12], None), now=1.0)
    remote.apply("gw-a", Add(1, "p0", [21], None), now=1.0)
    remote.apply("gw-a", Done(1, computed=True), now=1.0)  # settled, kept for the grace
    remote.apply("gw-c", Add(0, "p1", [11], None), now=1.0)
    assert remote.prune({"gw-b", "gw-c"}, asked=1.5) == 1
    assert set(remote.depths([11, 12], now=1.5)) == {"p1"}
    assert remote.depths([21], now=1.5)  # answered: it leaves with its grace, as it would
    assert not remote.depths([21], now=3.0)
    assert remote.table.keys == 1
    assert list(remote.origins()) == ["gw-c"]


def test_a_replica_heard_after_the_members_were_asked_for_is_kept() -> None:
    """It joined the list after it was read: it is dropped only if still absent next round."""
    remote = RemotePending(0.0)
    remote.apply("gw-a", Add(0, "p0", [11], None), now=2.0)
    assert remote.prune({"gw-b"}, asked=1.5) == 0
    assert remote.depths([11], now=2.0)["p0"].blocks == 1
    assert remote.prune({"gw-b"}, asked=2.5) == 1
