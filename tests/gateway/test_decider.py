"""The disaggregation decider on cases whose numbers can be checked by hand.

Every case uses prefill rates of 1,000 tokens/s, so a token is a millisecond, and
`itl_weight` 1 unless said otherwise.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gateway.load.pending import PendingHit
from gateway.load.tracker import Candidate
from gateway.requests.query import RouteQuery
from gateway.routing.decider import PdDecider, local_capable
from gateway.settings.routing import PdDeciderConfig
from globalkv.lookup import LookupResult, PodHit

BLOCK = 16


def request(
    prompt: int, *hits: tuple[str, int], pending: dict[str, int] | None = None
) -> RouteQuery:
    lookup = LookupResult(
        block_size=BLOCK,
        blocks=prompt // BLOCK,
        pods=[PodHit(pod, 0, tokens // BLOCK, tokens, tokens / BLOCK) for pod, tokens in hits],
        keys=list(range(prompt // BLOCK)),
    )
    sent = {w: PendingHit(blocks // BLOCK, None) for w, blocks in (pending or {}).items()}
    return RouteQuery(list(range(prompt)), lookup=lookup, pending=sent)


def rates(**by_worker: float | None) -> Callable[[str], float | None]:
    return lambda worker: by_worker.get(worker)


def decider(transfer: float = 80_000, itl_weight: float = 1.0) -> PdDecider:
    return PdDecider(
        PdDeciderConfig(
            mode="local-when-faster", transfer_tokens_per_s=transfer, itl_weight=itl_weight
        )
    )


def test_off_always_disaggregates() -> None:
    off = PdDecider(PdDeciderConfig())
    decision = off.decide(request(160), [Candidate("p", "p")], [Candidate("d", "d")], rates(p=1e3))
    assert (decision.local, decision.reason) == (False, "always")


def test_a_short_prompt_behind_a_busy_prefill_is_prefilled_on_the_decode() -> None:
    # remote: (2,000 queued + 160) / 1,000 + 160 / 1,600 transfer = 2.16 + 0.1 = 2.26 s
    # local:  160 / 1,000 = 0.16 s, stalling 2 running decodes 0.16 s each: 0.16 + 0.32 = 0.48 s
    decision = decider(transfer=1_600).decide(
        request(160),
        [Candidate("p", "p", remaining_prefill_tokens=2_000)],
        [Candidate("d", "d", in_flight=2)],
        rates(p=1_000),
    )
    assert (decision.local, decision.reason) == (True, "faster")
    assert decision.remote_s == pytest.approx(2.26)
    assert decision.local_s == pytest.approx(0.48)
    assert decision.choice is not None
    assert (decision.choice.worker, decision.choice.uncached_tokens) == ("d", 160)


def test_a_long_cold_prompt_is_disaggregated() -> None:
    # remote: 8,000 / 1,000 + 8,000 / 80,000 = 8.1 s; local: 8 s + 3 running × 8 s = 32 s
    decision = decider().decide(
        request(8_000), [Candidate("p", "p")], [Candidate("d", "d", in_flight=3)], rates(p=1_000)
    )
    assert (decision.local, decision.reason) == (False, "slower")
    assert decision.remote_s == pytest.approx(8.1)
    assert decision.local_s == pytest.approx(32.0)


def test_an_idle_decode_computing_the_same_tokens_wins_by_the_transfer_alone() -> None:
    # remote: 8 s + 0.1 s of transfer; local: 8 s and no decode to hold up
    decision = decider().decide(
        request(8_000), [Candidate("p", "p")], [Candidate("d", "d")], rates(p=1_000)
    )
    assert decision.local
    assert (decision.local_s, decision.remote_s) == (pytest.approx(8.0), pytest.approx(8.1))


def test_the_itl_weight_prices_the_running_decodes() -> None:
    # local 0.16 s + weight × 2 × 0.16 s against remote 0.16 + 0.1 = 0.26 s: local up to
    # weight 0.3125, disaggregated from there
    cases = {0.0: True, 0.3: True, 0.32: False, 1.0: False}
    for weight, local in cases.items():
        decision = decider(transfer=1_600, itl_weight=weight).decide(
            request(160), [Candidate("p", "p")], [Candidate("d", "d", in_flight=2)], rates(p=1e3)
        )
        assert decision.local is local, weight


def test_the_prefix_a_decode_holds_is_not_computed_again() -> None:
    # remote: the prefill holds nothing: 4,000 / 1,000 + 4,000 / 80,000 = 4.05 s
    # local on d: 3,840 held, 160 to compute, 4 running: 0.16 + 4 × 0.16 = 0.8 s
    decision = decider().decide(
        request(4_000, ("d", 3_840)),
        [Candidate("p", "p")],
        [Candidate("d", "d", in_flight=4)],
        rates(p=1_000),
    )
    assert decision.local
    assert decision.local_s == pytest.approx(0.8)
    assert decision.choice is not None
    assert (decision.choice.hit_tokens, decision.choice.uncached_tokens) == (3_840, 160)


def test_a_prefix_the_prefill_holds_too_makes_the_remote_path_as_cheap() -> None:
    # both hold 3,840: remote 0.16 + 0.05 = 0.21 s; local 0.16 + 4 × 0.16 = 0.8 s
    decision = decider().decide(
        request(4_000, ("d", 3_840), ("p", 3_840)),
        [Candidate("p", "p")],
        [Candidate("d", "d", in_flight=4)],
        rates(p=1_000),
    )
    assert (decision.local, decision.reason) == (False, "slower")
    assert decision.remote_s == pytest.approx(0.21)


def test_a_prompt_sent_to_a_decode_and_not_yet_indexed_counts_as_held_there() -> None:
    decision = decider().decide(
        request(4_000, pending={"d": 3_840}),
        [Candidate("p", "p")],
        [Candidate("d", "d", in_flight=4)],
        rates(p=1_000),
    )
    assert decision.local
    assert decision.local_s == pytest.approx(0.8)


def test_the_decode_of_lowest_cost_is_chosen_at_its_own_rate() -> None:
    # busy: 10 running → 0.16 + 10 × 0.16 = 1.76 s; slow: measured 500 tokens/s, 1 running,
    # its own queue 340 → (340 + 160) / 500 + 160 / 500 = 1.32 s; idle: 0.16 s; remote 2.26 s
    decision = decider(transfer=1_600).decide(
        request(160),
        [Candidate("p", "p", remaining_prefill_tokens=2_000)],
        [
            Candidate("busy", "busy", in_flight=10),
            Candidate("slow", "slow", in_flight=1, remaining_prefill_tokens=340),
            Candidate("idle", "idle"),
        ],
        rates(p=1_000, slow=500),
    )
    assert decision.decode is not None
    assert decision.decode.worker == "idle"
    assert decision.local_s == pytest.approx(0.16)
    without_idle = decider(transfer=1_600).decide(
        request(160),
        [Candidate("p", "p", remaining_prefill_tokens=2_000)],
        [Candidate("busy", "busy", in_flight=10), Candidate("slow", "slow", in_flight=1)],
        rates(p=1_000, slow=500),
    )
    assert without_idle.decode is not None
    assert without_idle.decode.worker == "slow"
    assert without_idle.local_s == pytest.approx(0.64)


def test_the_remote_side_is_the_best_prefill() -> None:
    # p1: 10,000 queued → 10.16 s; p2 holds 96 of the 160, at 2,000 tokens/s: 64 / 2,000 =
    # 0.032 s; + 0.1 s of transfer
    decision = decider(transfer=1_600).decide(
        request(160, ("p2", 96)),
        [Candidate("p1", "p1", remaining_prefill_tokens=10_000), Candidate("p2", "p2")],
        [Candidate("d", "d", in_flight=1)],
        rates(p1=1_000, p2=2_000),
    )
    assert decision.remote_s == pytest.approx(0.132)
    # local at the prefills' mean rate, 1,500 tokens/s: 160 / 1,500 × (1 + 1)
    assert decision.local_s == pytest.approx(160 / 1_500 * 2)
    assert not decision.local


def test_nothing_to_estimate_from_disaggregates() -> None:
    d = decider()
    prefills, decodes = [Candidate("p", "p")], [Candidate("d", "d")]
    assert d.decide(request(160), prefills, decodes, rates()).reason == "unmeasured"
    assert d.decide(request(160), prefills, [], rates(p=1e3)).reason == "no_local_decode"
    no_lookup = RouteQuery(list(range(160)))
    assert d.decide(no_lookup, prefills, decodes, rates(p=1e3)).reason == "no_lookup"


def test_only_vllm_decodes_prefill_locally() -> None:
    assert local_capable("vllm")
    assert not local_capable("sglang")
