"""The prompts a gateway sent and the index cannot show yet: table, tracker, policy."""

from __future__ import annotations

from random import Random

import pytest

from gateway.config import PrefixWeights
from gateway.policies import Candidate, LoadTracker, RouteRequest, build_policy
from gateway.policies.pending import PendingPrefixes
from globalkv.lookup import LookupResult, PodHit


def test_depth_is_the_contiguous_run_of_leading_keys_per_worker() -> None:
    table = PendingPrefixes()
    table.add("a", [1, 2, 3, 4])
    table.add("b", [1, 2, 9])
    table.add("c", [7, 8])
    assert table.depths([1, 2, 3, 5], now=0.0) == {"a": 3, "b": 2}
    assert table.depths([1, 2, 9, 10], now=0.0) == {"a": 2, "b": 3}
    assert table.depths([7, 8, 1], now=0.0) == {"c": 2}
    assert table.depths([], now=0.0) == {}


def test_a_settled_entry_lasts_the_grace_and_a_shared_key_outlives_one_holder() -> None:
    table = PendingPrefixes(grace_s=2.0)
    first = table.add("a", [1, 2])
    table.add("a", [1, 2, 3])
    table.settle(first, now=10.0)
    assert table.depths([1, 2, 3], now=11.9) == {"a": 3}
    assert table.depths([1, 2, 3], now=12.0) == {"a": 3}, "the other prompt still holds them"
    assert table.keys == 3
    table.settle(first, now=20.0)
    assert table.keys == 3, "settling twice removes once"


def test_grace_zero_removes_at_once_and_forget_drops_a_worker() -> None:
    table = PendingPrefixes(grace_s=0.0)
    entry = table.add("a", [1, 2])
    table.add("b", [1])
    table.settle(entry, now=0.0)
    assert table.depths([1, 2], now=0.0) == {"b": 1}
    table.forget("b")
    assert table.depths([1, 2], now=0.0) == {}
    assert table.keys == 0


def test_the_key_bound_keeps_the_prefix_that_fits() -> None:
    table = PendingPrefixes(max_keys=3)
    table.add("a", [1, 2])
    table.add("b", [1, 2, 3])
    assert table.keys == 3
    assert table.depths([1, 2, 3], now=0.0) == {"a": 2, "b": 1}


def test_negative_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="must not be negative"):
        PendingPrefixes(grace_s=-1)


def test_the_tracker_records_keys_until_the_grace_after_prefill_done() -> None:
    now = [0.0]
    loads = LoadTracker(pending=PendingPrefixes(grace_s=1.0), clock=lambda: now[0])
    ticket = loads.start("p", 100, keys=[5, 6])
    assert loads.pending_blocks([5, 6, 7]) == {"p": 2}
    now[0] = 3.0
    loads.finish(ticket)
    assert loads.pending_blocks([5, 6]) == {"p": 2}
    now[0] = 4.0
    assert loads.pending_blocks([5, 6]) == {}
    failed = loads.start("p", 100, keys=[5, 6])
    loads.finish(failed, computed=False)
    assert loads.pending_blocks([5, 6]) == {}, "a prefill that failed holds nothing"
    untracked = LoadTracker(pending=None)
    untracked.start("p", 100, keys=[5, 6])
    assert untracked.pending_blocks([5, 6]) == {}


def test_prefix_counts_what_it_sent_where_the_index_shows_less() -> None:
    """The index shows 160 tokens on pod-b; 40 blocks (640 tokens) were sent to a."""
    policy = build_policy("prefix", Random(0), prefix=PrefixWeights(queued_weight=1.0))
    lookup = LookupResult(16, 62, [PodHit("pod-b", 1, 10, 160, 10.0)], keys=list(range(62)))
    request = RouteRequest(tokens=[1] * 1000, lookup=lookup, pending={"a": 40})
    candidates = [Candidate("a", "pod-a"), Candidate("b", "pod-b")]
    choice = policy.choose(request, candidates)
    assert (choice.worker, choice.hit_tokens, choice.uncached_tokens) == ("a", 640, 360)
    assert choice.dp_rank is None, "no rank is known for what was only sent"
    loaded = [Candidate("a", "pod-a", 1, 600), Candidate("b", "pod-b")]
    assert policy.choose(request, loaded).worker == "b", "what was sent weighs like a hit"
    weights = PrefixWeights(queued_weight=0.5)
    lighter = build_policy("prefix", Random(0), prefix=weights)
    assert lighter.choose(request, loaded).worker == "a"
