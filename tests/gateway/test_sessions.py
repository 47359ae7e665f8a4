"""Sessions: a conversation kept on its prefill while that prefill is fit to serve it."""

from __future__ import annotations

import json
from random import Random

import pytest

from gateway.config import PrefixWeights
from gateway.http.answer import Answer
from gateway.inference import Inference
from gateway.policies import RouteRequest, build_policy
from gateway.policies.sessions import SessionTable
from tests.gateway.fakes import PREFILLS, Cluster, StubLookup, config, make_gateway
from tests.gateway.test_policies import cand, hits


def test_a_binding_lives_until_idle_for_the_ttl() -> None:
    table = SessionTable(ttl=10, capacity=100)
    table.bind("s", "a", now=0)
    assert table.get("s", now=9) == "a"
    table.bind("s", "a", now=9)
    assert table.get("s", now=18) == "a"  # idle time restarts with each turn
    assert table.get("s", now=19) is None
    assert len(table) == 0


def test_the_least_recent_binding_goes_past_the_capacity() -> None:
    table = SessionTable(ttl=100, capacity=2)
    for number, session in enumerate("abc"):
        table.bind(session, "w", now=number)
    assert (table.get("a", 3), table.get("b", 3), table.get("c", 3)) == (None, "w", "w")


def test_bad_table_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        SessionTable(ttl=0, capacity=1)


def session_request(
    session: str | None, *pods: tuple[str, int, int], now: float = 0
) -> RouteRequest:
    return RouteRequest(tokens=list(range(1000)), lookup=hits(*pods), now=now, session=session)


def test_a_session_stays_on_its_prefill_though_another_is_a_little_better() -> None:
    policy = build_policy("prefix", Random(0))
    first = policy.choose(session_request("s", ("a", 0, 640)), [cand("a"), cand("b")])
    assert first.worker == "a"
    # b now holds more (a copy) and a is a little busy: prefix alone would move
    later = session_request("s", ("a", 0, 640), ("b", 0, 800), now=1)
    assert policy.choose(later, [cand("a", queued=300), cand("b")]).worker == "a"
    alone = session_request(None, ("a", 0, 640), ("b", 0, 800), now=1)
    assert policy.choose(alone, [cand("a", queued=300), cand("b")]).worker == "b"


def test_a_session_leaves_an_overloaded_or_ineligible_prefill_and_is_bound_anew() -> None:
    policy = build_policy("prefix", Random(0))
    policy.choose(session_request("s", ("a", 0, 640)), [cand("a"), cand("b")])
    # a's queue outweighs computing the whole prompt on b
    busy = session_request("s", ("a", 0, 640), now=1)
    assert policy.choose(busy, [cand("a", queued=5000), cand("b")]).worker == "b"
    assert policy.choose(session_request("s", now=2), [cand("b"), cand("c")]).worker == "b"
    gone = session_request("s", ("b", 0, 640), now=3)
    assert policy.choose(gone, [cand("a"), cand("c")]).worker in {"a", "c"}


def test_without_the_index_a_session_still_stays_unless_overloaded() -> None:
    policy = build_policy("prefix", Random(0))
    first = policy.choose(session_request("s", ("a", 0, 640)), [cand("a"), cand("b")])
    blind = RouteRequest(tokens=list(range(1000)), lookup=None, now=1, session="s")
    kept = policy.choose(blind, [cand("a", queued=500), cand("b")])
    assert (kept.worker, kept.fallback) == (first.worker, "no_lookup")
    moved = policy.choose(blind, [cand("a", queued=5000), cand("b")])
    assert moved.worker == "b"


def test_sessions_can_be_turned_off() -> None:
    policy = build_policy("prefix", Random(0), prefix=PrefixWeights(session_ttl_secs=None))
    policy.choose(session_request("s", ("a", 0, 640)), [cand("a"), cand("b")])
    later = session_request("s", ("a", 0, 640), ("b", 0, 800), now=1)
    assert policy.choose(later, [cand("a", queued=300), cand("b")]).worker == "b"


@pytest.mark.parametrize("header", [b"x-smg-routing-key", b"x-dynamo-session-id"])
async def test_the_session_header_keeps_a_conversation_on_one_prefill(header: bytes) -> None:
    cluster = Cluster()
    inference = Inference(await make_gateway(cluster, config(), lookup=StubLookup()))
    for turn in range(6):
        body = json.dumps({"input_ids": list(range(turn + 1))}).encode()
        answer = await inference.handle("/generate", None, body, [(header, b"conversation-1")])
        assert isinstance(answer, Answer)
        assert answer.status == 200
    prefills = {call.worker for call in cluster.inference("prefill")}
    assert len(prefills) == 1
    assert prefills <= {url.split("//")[1] for url in PREFILLS}


async def test_a_session_header_too_long_is_a_400() -> None:
    cluster = Cluster()
    inference = Inference(await make_gateway(cluster, config(), lookup=StubLookup()))
    headers = [(b"x-dynamo-session-id", b"s" * 257)]
    answer = await inference.handle("/generate", None, b'{"input_ids": [1]}', headers)
    assert isinstance(answer, Answer)
    assert answer.status == 400
    assert cluster.inference() == []
