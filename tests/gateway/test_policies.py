"""Policies in isolation: pure inputs, seeded RNG, simulated time."""

from __future__ import annotations

from random import Random

import pytest

from gateway.load.tracker import Candidate, LoadTracker
from gateway.policies import Choice, build_policy
from gateway.policies.radix import RadixTree
from gateway.requests.query import RouteQuery
from gateway.settings.routing import CacheAwareConfig, PrefixWeights
from globalkv.lookup import LookupResult, PodHit


def hits(*pods: tuple[str, int, int], block_size: int = 16, blocks: int = 100) -> LookupResult:
    return LookupResult(
        block_size=block_size,
        blocks=blocks,
        pods=[PodHit(pod, dp, t // block_size, t, float(t // block_size)) for pod, dp, t in pods],
    )


def cand(
    worker: str,
    in_flight: int = 0,
    queued: int = 0,
    pod: str | None = None,
    remaining: int | None = None,
) -> Candidate:
    """`remaining` defaults to all of `queued`: a worker whose prefill rate is not yet known."""
    left = queued if remaining is None else remaining
    return Candidate(worker, pod or worker, in_flight, queued, left)


def test_prefix_prefers_the_longest_hit_when_idle() -> None:
    policy = build_policy("prefix", Random(0))
    request = RouteQuery(
        tokens=list(range(1000)), lookup=hits(("pod-b", 1, 640), ("pod-a", 0, 320))
    )
    choice = policy.choose(request, [cand("a", pod="pod-a"), cand("b", pod="pod-b")])
    assert (choice.worker, choice.dp_rank, choice.hit_tokens, choice.uncached_tokens) == (
        "b",
        1,
        640,
        360,
    )
    assert choice.fallback is None


def test_prefix_long_hit_on_overloaded_pod_loses_to_short_hit_on_idle_pod() -> None:
    """The docstring's example: 8,000-token prompt, 6,000 cached behind 14,000 queued."""
    policy = build_policy("prefix", Random(0))
    request = RouteQuery(tokens=[1] * 8000, lookup=hits(("busy", 0, 6000), ("idle", 0, 1000)))
    choice = policy.choose(request, [cand("busy", queued=14_000), cand("idle")])
    assert choice.worker == "idle"
    assert choice.uncached_tokens == 7000


def test_prefix_weighs_the_estimated_rest_of_the_queue_not_all_that_was_sent() -> None:
    """The same busy pod, estimated to have 2,000 of its 14,000 tokens left: 2,000 + 1,000
    beats the idle pod's 7,000, so the prompt stays with its prefix."""
    policy = build_policy("prefix", Random(0))
    request = RouteQuery(tokens=[1] * 8000, lookup=hits(("busy", 0, 6000), ("idle", 0, 1000)))
    choice = policy.choose(request, [cand("busy", queued=14_000, remaining=2000), cand("idle")])
    assert (choice.worker, choice.uncached_tokens) == ("busy", 2000)


def test_prefix_weights_change_the_decision() -> None:
    weights = PrefixWeights(uncached_weight=1.0, queued_weight=0.1)
    policy = build_policy("prefix", Random(0), prefix=weights)
    request = RouteQuery(tokens=[1] * 8000, lookup=hits(("busy", 0, 6000), ("idle", 0, 1000)))
    assert policy.choose(request, [cand("busy", queued=14_000), cand("idle")]).worker == "busy"
    costly = build_policy("prefix", Random(0), prefix=PrefixWeights(request_cost=10_000))
    no_hit = RouteQuery(tokens=[1] * 100, lookup=hits())
    assert costly.choose(no_hit, [cand("x", in_flight=1), cand("y")]).worker == "y"


def test_prefix_best_dp_rank_of_a_pod_is_counted() -> None:
    policy = build_policy("prefix", Random(0))
    request = RouteQuery(tokens=[1] * 100, lookup=hits(("p", 0, 16), ("p", 3, 64)))
    choice = policy.choose(request, [cand("w", pod="p")])
    assert (choice.dp_rank, choice.hit_tokens) == (3, 64)


def test_prefix_without_lookup_falls_back_to_least_load() -> None:
    policy = build_policy("prefix", Random(0))
    choice = policy.choose(RouteQuery(tokens=None), [cand("a", queued=50), cand("b", queued=5)])
    assert (choice.worker, choice.fallback) == ("b", "no_lookup")


def test_ties_are_broken_by_the_seeded_rng_reproducibly() -> None:
    def run(seed: int) -> list[str]:
        policy = build_policy("prefix", Random(seed))
        request = RouteQuery(tokens=[1] * 10, lookup=hits())
        return [policy.choose(request, [cand("a"), cand("b"), cand("c")]).worker for _ in range(30)]

    assert run(3) == run(3)
    assert set(run(3)) == {"a", "b", "c"}


def test_round_robin_cycles() -> None:
    policy = build_policy("round_robin", Random(0))
    picks = [policy.choose(RouteQuery(None), [cand("a"), cand("b")]).worker for _ in range(4)]
    assert picks == ["a", "b", "a", "b"]


def test_random_uses_its_rng() -> None:
    a = build_policy("random", Random(9))
    b = build_policy("random", Random(9))
    cands = [cand(str(i)) for i in range(5)]
    assert [a.choose(RouteQuery(None), cands).worker for _ in range(20)] == [
        b.choose(RouteQuery(None), cands).worker for _ in range(20)
    ]


def test_least_load_orders_by_queued_tokens_then_in_flight() -> None:
    policy = build_policy("least_load", Random(0))
    cands = [cand("a", in_flight=1, queued=10), cand("b", in_flight=5, queued=0), cand("c", 0, 10)]
    assert policy.choose(RouteQuery(None), cands).worker == "b"
    assert policy.choose(RouteQuery(None), [cand("a", 2, 0), cand("c", 1, 0)]).worker == "c"


def test_power_of_two_never_picks_the_more_loaded_of_two() -> None:
    policy = build_policy("power_of_two", Random(5))
    cands = [cand("hot", in_flight=9), cand("cold", in_flight=0)]
    assert {policy.choose(RouteQuery(None), cands).worker for _ in range(20)} == {"cold"}
    assert policy.choose(RouteQuery(None), [cand("only")]).worker == "only"


def test_cache_aware_follows_the_tree_when_balanced() -> None:
    policy = build_policy("cache_aware", Random(0))
    cands = [cand("a"), cand("b")]
    first = policy.choose(RouteQuery(tokens=[1, 2, 3, 4, 5, 6], now=0.0), cands)
    again = policy.choose(RouteQuery(tokens=[1, 2, 3, 4, 5, 9], now=1.0), cands)
    assert again.worker == first.worker
    assert again.hit_tokens == 5
    other = policy.choose(RouteQuery(tokens=[7, 8, 9], now=2.0), cands)
    assert other.worker != first.worker, "a miss goes to the emptiest tree"


def test_cache_aware_balances_when_imbalanced() -> None:
    policy = build_policy("cache_aware", Random(0), cache_aware=CacheAwareConfig())
    cands = [cand("a", in_flight=0), cand("b", in_flight=0)]
    policy.choose(RouteQuery(tokens=[1, 2, 3]), cands)
    holder = policy.choose(RouteQuery(tokens=[1, 2, 3]), cands).worker
    other = "b" if holder == "a" else "a"
    mild = [cand(holder, in_flight=60), cand(other, in_flight=0)]
    assert policy.choose(RouteQuery(tokens=[1, 2, 3]), mild).worker == holder, "abs 64 not met"
    loaded = [cand(holder, in_flight=200), cand(other, in_flight=10)]
    assert policy.choose(RouteQuery(tokens=[1, 2, 3]), loaded).worker == other


def test_cache_aware_uses_text_without_tokens_and_load_without_either() -> None:
    policy = build_policy("cache_aware", Random(0))
    cands = [cand("a"), cand("b", queued=1)]
    first = policy.choose(RouteQuery(tokens=None, text="hello world"), cands).worker
    assert policy.choose(RouteQuery(tokens=None, text="hello there"), cands).worker == first
    blind = policy.choose(RouteQuery(tokens=None), cands)
    assert (blind.worker, blind.fallback) == ("a", "no_tokens")


def test_cache_aware_evicts_on_simulated_time() -> None:
    config = CacheAwareConfig(eviction_interval_secs=10, max_tree_size=4)
    policy = build_policy("cache_aware", Random(0), cache_aware=config)
    cands = [cand("a")]
    policy.choose(RouteQuery(tokens=[1, 2, 3, 4, 5, 6], now=0.0), cands)
    policy.choose(RouteQuery(tokens=[9, 9], now=5.0), cands)
    tree = policy.tree  # type: ignore[attr-defined]
    assert tree.sizes["a"] == 8
    policy.choose(RouteQuery(tokens=[9, 9], now=10.0), cands)
    assert tree.sizes["a"] <= 4
    assert tree.match([9, 9], {"a"}) == (2, "a"), "the recently used branch survives"
    policy.forget("a")
    assert "a" not in tree.sizes


def test_radix_tree_splits_matches_and_evicts_lru() -> None:
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], "x", now=1)
    tree.insert([1, 2, 5], "y", now=2)
    tree.insert([1, 2, 3, 9], "x", now=3)
    assert tree.match([1, 2, 3, 4, 7], {"x", "y"}) == (4, "x")
    assert tree.match([1, 2, 5], {"x", "y"}) == (3, "y")
    assert tree.match([1, 2], {"x", "y"}) == (2, "x"), "most recent holder"
    assert tree.match([1, 2, 5], {"x"}) == (2, "x"), "only allowed tenants count"
    assert tree.match([8], {"x"}) == (0, None)
    assert tree.sizes == {"x": 5, "y": 3}
    tree.evict(4)
    assert tree.sizes["x"] == 4
    assert tree.match([1, 2, 3, 4], {"x"}) == (3, "x"), "the older leaf went first"
    tree.remove_tenant("y")
    assert tree.match([1, 2, 5], {"y"}) == (0, None)
    assert tree.match([1, 2, 3, 9], {"x"}) == (4, "x")


def test_load_tracker_hooks_are_idempotent() -> None:
    loads = LoadTracker()
    ticket = loads.start_prefill(Choice("p", uncached_tokens=100))
    other = loads.start_prefill(Choice("p", uncached_tokens=20))
    assert loads.candidate("p", "pod") == Candidate("p", "pod", 2, 120, 120), "no rate yet"
    loads.prefill_done(ticket)
    loads.prefill_done(ticket)
    assert loads.load("p").queued_prefill_tokens == 20
    loads.finish(ticket)
    loads.finish(ticket)
    loads.finish(other)
    assert (loads.load("p").in_flight, loads.load("p").queued_prefill_tokens) == (0, 0)
    stale = loads.start_prefill(Choice("q", uncached_tokens=5))
    loads.forget("q")
    loads.finish(stale)
    assert loads.load("q").in_flight == 0
    assert loads.candidates(["q", ("r", "pod-r")])[1].pod == "pod-r"


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        build_policy("bucket", Random(0))  # type: ignore[arg-type]
