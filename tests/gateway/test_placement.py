"""The prefix policy's cache-pressure cost on small cases checked by hand.

Blocks of 16 tokens, caches of 100 blocks (1,600 tokens) unless said otherwise. A worker's
ledger is filled through `PlacementLedger.record`, as the policy's own choices fill it.
"""

from __future__ import annotations

from random import Random

import pytest

from gateway.load.tracker import Candidate
from gateway.policies import build_policy
from gateway.policies.placement import PlacementLedger
from gateway.policies.prefix import PrefixPolicy
from gateway.requests.query import RouteQuery
from gateway.settings.routing import PrefixWeights
from globalkv.lookup import LookupResult, PodHit

BS = 16
CAPACITY = 100


def lookup(blocks: int, *held: tuple[str, int], first_key: int = 10_000) -> LookupResult:
    """A prompt of `blocks` blocks with keys first_key.., held as (pod, blocks) pairs."""
    return LookupResult(
        block_size=BS,
        blocks=blocks,
        keys=list(range(first_key, first_key + blocks)),
        pods=[PodHit(pod, 0, n, n * BS, float(n)) for pod, n in held],
    )


def request(blocks: int, *held: tuple[str, int], first_key: int = 10_000) -> RouteQuery:
    return RouteQuery(tokens=[1] * (blocks * BS), lookup=lookup(blocks, *held, first_key=first_key))


def cand(worker: str, capacity_blocks: int | None = CAPACITY, queued: int = 0) -> Candidate:
    capacity = None if capacity_blocks is None else capacity_blocks * BS
    return Candidate(worker, worker, 0, queued, queued, capacity)


def prefix_policy(**weights: float) -> PrefixPolicy:
    policy = build_policy("prefix", Random(0), prefix=PrefixWeights(**weights))
    assert isinstance(policy, PrefixPolicy)
    return policy


def fill(policy: PrefixPolicy, worker: str, blocks: int, capacity: int = CAPACITY) -> None:
    """`blocks` distinct blocks computed on `worker`, none of them seen before."""
    policy.ledger.record(worker, capacity, list(range(blocks)), 0)


def test_ledger_share_and_eviction_by_hand() -> None:
    ledger = PlacementLedger()
    assert ledger.recompute_share() == 1.0  # nothing seen: every eviction counts
    ledger.record("a", CAPACITY, list(range(90)), 0)
    # 90 new blocks: both sums (100 to start) keep 0.5 ** 0.9 = 0.5359 and the computed
    # one adds 90: share = 53.59 / 143.59.
    assert ledger.recompute_share() == pytest.approx(53.59 / 143.59, rel=1e-3)
    share = ledger.recompute_share()
    assert ledger.placed("a") == 90
    # 10 more on a (100 of 100 placed): all 10 evict; on an empty b only the fill, 10 %.
    assert ledger.eviction("a", CAPACITY, 10) == pytest.approx(10 * share)
    assert ledger.eviction("b", CAPACITY, 10) == pytest.approx(10 * 0.1 * share)
    assert ledger.eviction("a", CAPACITY, 0) == 0.0
    # 4 new and 6 copied on b: the fill counts all 10, each copied block weighs twice.
    assert ledger.eviction("b", CAPACITY, 4, 6) == pytest.approx((4 + 2 * 6) * 0.1 * share)
    assert ledger.eviction("a", CAPACITY, 0, 10) == pytest.approx(20 * share)


def test_demand_is_the_share_of_the_recent_prompts_holding_a_key() -> None:
    ledger = PlacementLedger(demand_window=4)
    assert ledger.demand(1) == 0.0
    ledger.record("a", CAPACITY, [1, 2, 3], 0)
    ledger.record("b", CAPACITY, [1, 2, 9], 0)
    ledger.record("a", CAPACITY, [7], 0)
    assert (ledger.demand(1), ledger.demand(3), ledger.demand(5)) == (2 / 3, 1 / 3, 0.0)
    # Three more prompts push the first two out of the window of four.
    ledger.record("a", CAPACITY, [1], 0)
    ledger.record("a", CAPACITY, [8], 0)
    ledger.record("b", CAPACITY, [8], 0)
    assert (ledger.demand(1), ledger.demand(2), ledger.demand(9)) == (1 / 4, 0.0, 0.0)
    with pytest.raises(ValueError, match="demand_window"):
        PlacementLedger(demand_window=0)


def test_blocks_placed_before_and_computed_again_raise_the_share() -> None:
    ledger = PlacementLedger()
    ledger.record("a", CAPACITY, list(range(100)), 0)
    cold = ledger.recompute_share()
    # The same 100 blocks computed again (the cache had evicted them): all recomputed.
    ledger.record("a", CAPACITY, list(range(100)), 0)
    assert ledger.recompute_share() > cold
    # A hit is not computed: the sums do not move.
    before = ledger.recompute_share()
    ledger.record("a", CAPACITY, list(range(100)), 100)
    assert ledger.recompute_share() == before


def test_ledger_keeps_at_most_retain_capacities_most_recent_last() -> None:
    ledger = PlacementLedger(retain=2.0)
    ledger.record("a", 10, list(range(15)), 0)
    ledger.record("a", 10, list(range(100, 110)), 0)
    assert ledger.placed("a") == 20
    # The oldest five went; re-placing them evicts five of the next oldest.
    ledger.record("a", 10, list(range(5)), 0)
    assert ledger.placed("a") == 20
    ledger.forget("a")
    assert ledger.placed("a") == 0
    with pytest.raises(ValueError, match="retain"):
        PlacementLedger(retain=0.5)


def test_a_pod_near_capacity_loses_a_cold_prompt_to_an_emptier_pod() -> None:
    policy = prefix_policy()
    fill(policy, "full", 95)
    # 10 new blocks: on "full" 10 x min(105/100, 1) evicted, on "empty" 10 x 0.1; each at
    # 2 x 16 tokens x share. Both idle: without the pressure this is a coin toss.
    choice = policy.choose(request(10), [cand("full"), cand("empty")])
    assert choice.worker == "empty"
    # The choice is recorded: "empty" now holds those ten blocks.
    assert policy.ledger.placed("empty") == 10


def test_coin_tosses_among_idle_pods_without_the_pressure() -> None:
    chosen = set()
    for seed in range(12):
        policy = build_policy("prefix", Random(seed), prefix=PrefixWeights(pressure_weight=0))
        assert isinstance(policy, PrefixPolicy)
        fill(policy, "full", 95)
        chosen.add(policy.choose(request(10), [cand("full"), cand("empty")]).worker)
    assert chosen == {"full", "empty"}


def test_a_held_prefix_still_wins_when_its_value_exceeds_the_eviction_cost() -> None:
    policy = prefix_policy()
    fill(policy, "holder", CAPACITY)
    # "holder" is full but holds 60 of the prompt's 80 blocks: 20 x 16 = 320 uncached
    # tokens + at most 2 x 16 x 20 for evicting; "empty" computes all 1,280.
    choice = policy.choose(request(80, ("holder", 60)), [cand("holder"), cand("empty")])
    assert (choice.worker, choice.hit_tokens) == ("holder", 60 * BS)


def test_a_short_prefix_on_a_full_pod_loses_to_room_elsewhere() -> None:
    policy = prefix_policy()
    fill(policy, "holder", 1000, capacity=1000)
    share = policy.ledger.recompute_share()
    # A 100-block prompt of which "holder" keeps 2, caches of 1,000 blocks: holder
    # 98 x 16 x (1 + 2 x share); empty computes 98 new and 2 copied blocks at a 10 % fill,
    # 100 x 16 + 2 x 16 x 0.1 x share x (98 + 2 x 2).
    holder = 98 * BS * (1 + 2 * share)
    empty = 100 * BS + 2 * BS * 0.1 * share * (98 + 2 * 2)
    assert empty < holder
    candidates = [cand("holder", 1000), cand("empty", 1000)]
    assert policy.choose(request(100, ("holder", 2)), candidates).worker == "empty"
    # Without the pressure the two blocks it holds keep the prompt there.
    plain = prefix_policy(pressure_weight=0)
    fill(plain, "holder", 1000, capacity=1000)
    assert plain.choose(request(100, ("holder", 2)), candidates).worker == "holder"


def _copy_costs(policy: PrefixPolicy) -> tuple[float, float, float]:
    """A 40-block prompt, 30 of them on a full "holder", against an empty "spare": the
    costs other than the holder's queue, the spare's with its 30 copied blocks charged
    and with them free. Caches of 100 blocks: holder fill 1, spare (0 + 40) / 100."""
    share = policy.ledger.recompute_share()
    holder = 10 * BS + 2 * BS * share * 10
    spare_charged = 40 * BS + 2 * BS * share * 0.4 * (10 + 2 * 30)
    spare_free = 40 * BS + 2 * BS * share * 0.4 * 10
    return holder, spare_charged, spare_free


def test_a_copy_of_a_prefix_few_prompts_want_is_charged_twice() -> None:
    policy = prefix_policy()
    fill(policy, "holder", CAPACITY)
    holder, charged, free = _copy_costs(policy)
    # A queue on the holder halfway between the two break-even points: with the copy
    # charged the holder still wins, with it free the spare would.
    queued = round(2 * ((charged + free) / 2 - holder))
    assert holder + queued / 2 < charged
    assert holder + queued / 2 > free
    req = request(40, ("holder", 30))
    choice = policy.choose(req, [cand("holder", queued=queued), cand("spare")])
    assert choice.worker == "holder"


def test_a_prefix_wanted_beyond_its_holders_share_is_copied_without_the_charge() -> None:
    policy = prefix_policy()
    fill(policy, "holder", CAPACITY)
    keys = list(range(10_000, 10_040))
    for _ in range(3):  # 3 of the last 4 prompts want it: 0.75 x 2 candidates > 1 holder
        policy.ledger.record("holder", CAPACITY, keys, 30)
    assert policy.ledger.demand(keys[29]) == 0.75
    holder, charged, free = _copy_costs(policy)
    queued = round(2 * ((charged + free) / 2 - holder))
    assert holder + queued / 2 < charged
    assert holder + queued / 2 > free
    req = request(40, ("holder", 30))
    choice = policy.choose(req, [cand("holder", queued=queued), cand("spare")])
    assert (choice.worker, choice.hit_tokens) == ("spare", 0)


@pytest.mark.parametrize(("wanting", "copied"), [(5, True), (4, False)])
def test_two_holders_need_more_than_two_thirds_of_the_prompts_to_be_copied_free(
    wanting: int, copied: bool
) -> None:
    # 3 candidates, 2 of them holding the prefix: free only if demand x 3 > 2. Of the 7
    # prompts recorded (the two fills and 5 more) 5 want it: 5 / 7 x 3 = 2.14; 4: 1.71.
    policy = prefix_policy()
    fill(policy, "holder", CAPACITY)
    policy.ledger.record("other", CAPACITY, list(range(200, 300)), 0)
    keys = list(range(10_000, 10_040))
    for _ in range(wanting):
        policy.ledger.record("holder", CAPACITY, keys, 30)
    for i in range(5 - wanting):
        policy.ledger.record("other", CAPACITY, [50_000 + i], 0)
    assert policy.ledger.demand(keys[29]) == wanting / 7
    holder, charged, free = _copy_costs(policy)
    queued = round(2 * ((charged + free) / 2 - holder))
    req = request(40, ("holder", 30), ("other", 30))
    candidates = [cand("holder", queued=queued), cand("other", queued=queued), cand("spare")]
    choice = policy.choose(req, candidates)
    assert (choice.worker == "spare") is copied


def test_unreported_capacity_costs_nothing_and_records_nothing() -> None:
    policy = prefix_policy()
    choice = policy.choose(request(10), [cand("a", None), cand("b", None, queued=1)])
    assert choice.worker == "a"
    assert policy.ledger.placed("a") == 0


@pytest.mark.parametrize(
    "name", ["cache_aware", "least_load", "power_of_two", "random", "round_robin"]
)
def test_other_policies_choose_the_same_with_or_without_capacities(name: str) -> None:
    with_capacity = build_policy(name, Random(3))
    without = build_policy(name, Random(3))
    for i in range(40):
        queued = [(i * 7 + k * 3) % 5 for k in range(3)]
        req = request(4 + i % 6, first_key=1000 * (i % 4))
        a = with_capacity.choose(req, [cand(f"w{k}", 10, q) for k, q in enumerate(queued)])
        b = without.choose(req, [cand(f"w{k}", None, q) for k, q in enumerate(queued)])
        assert a == b


def test_prefix_with_pressure_off_chooses_as_without_capacities() -> None:
    off = prefix_policy(pressure_weight=0)
    unknown = prefix_policy()
    for i in range(40):
        req = request(4 + i % 6, ("w1", i % 3), first_key=1000 * (i % 4))
        queued = [(i * 7 + k * 3) % 5 * 16 for k in range(3)]
        a = off.choose(req, [cand(f"w{k}", 10, q) for k, q in enumerate(queued)])
        b = unknown.choose(req, [cand(f"w{k}", None, q) for k, q in enumerate(queued)])
        assert a == b
