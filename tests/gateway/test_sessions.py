"""Sessions: a conversation kept on its prefill while that prefill is fit to serve it."""

from __future__ import annotations

import json
from random import Random

import pytest

from gateway.http.answer import Answer
from gateway.policies import build_policy
from gateway.policies.sessions import SessionTable, Turn
from gateway.requests.query import RouteQuery
from gateway.serving.inference import Inference
from gateway.settings.routing import PrefixWeights
from globalkv.keys import request_keys
from globalkv.lookup import LookupResult
from tests.gateway.fakes import PREFILLS, Cluster, StubLookup, config, make_gateway
from tests.gateway.test_policies import cand, hits


def test_a_binding_lives_until_idle_for_the_ttl() -> None:
    table = SessionTable(ttl=10, capacity=100)
    table.bind("s", Turn("a", 10), now=0)
    assert table.get("s", now=9) == Turn("a", 10)
    table.bind("s", Turn("a", 20), now=9)
    assert table.get("s", now=18) == Turn("a", 20)  # idle time restarts with each turn
    assert table.get("s", now=19) is None
    assert len(table) == 0


def test_the_least_recent_binding_goes_past_the_capacity() -> None:
    table = SessionTable(ttl=100, capacity=2)
    for number, session in enumerate("abc"):
        table.bind(session, Turn("w", 1), now=number)
    assert [table.get(s, 3) for s in "abc"] == [None, Turn("w", 1), Turn("w", 1)]


def test_bad_table_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        SessionTable(ttl=0, capacity=1)


BLOCK = 16
CONVERSATION = list(range(640))
"""The first turn: 40 blocks."""


def turn(
    tokens: list[int], *pods: tuple[str, int, int], now: float = 0, session: str | None = "s"
) -> RouteQuery:
    lookup = LookupResult(
        block_size=BLOCK,
        blocks=len(tokens) // BLOCK,
        pods=hits(*pods).pods,
        keys=request_keys(tokens, BLOCK, "m"),
    )
    return RouteQuery(tokens=tokens, lookup=lookup, now=now, session=session)


NEXT = [*CONVERSATION, *range(1000, 1320)]
"""The second turn: the first, then 20 blocks more."""


def test_a_turn_the_index_does_not_show_stays_where_its_last_turn_went() -> None:
    policy = build_policy("prefix", Random(0))
    first = policy.choose(turn(CONVERSATION), [cand("a"), cand("b")]).worker
    # the index has not seen the first turn yet (or cannot see): the session tells
    second = policy.choose(turn(NEXT, now=1), [cand("a"), cand("b")])
    assert (second.worker, second.hit_tokens) == (first, 640)
    # without the session the two pods tie
    alone = build_policy("prefix", Random(1))
    choices = {
        alone.choose(turn(NEXT, session=None), [cand("a"), cand("b")]).worker for _ in range(8)
    }
    assert choices == {"a", "b"}


def test_a_session_leaves_an_overloaded_prefill_and_follows_the_choice() -> None:
    policy = build_policy("prefix", Random(0))
    first = policy.choose(turn(CONVERSATION), [cand("a"), cand("b")]).worker
    other = "b" if first == "a" else "a"
    busy = [cand(first, queued=5000), cand(other)]  # its queue outweighs the prefix held
    assert policy.choose(turn(NEXT, now=1), busy).worker == other
    third = [*NEXT, *range(2000, 2016)]
    assert policy.choose(turn(third, now=2), [cand("a"), cand("b")]).worker == other


def test_a_prompt_that_does_not_extend_the_last_turn_gets_no_credit() -> None:
    policy = build_policy("prefix", Random(0))
    first = policy.choose(turn(CONVERSATION), [cand("a"), cand("b")]).worker
    elsewhere = list(range(5000, 5960))
    assert policy.choose(turn(elsewhere, now=1), [cand("a"), cand("b")]).hit_tokens == 0
    assert first in {"a", "b"}


def test_a_session_leaves_a_prefill_that_is_no_longer_a_candidate() -> None:
    policy = build_policy("prefix", Random(0))
    first = policy.choose(turn(CONVERSATION), [cand("a"), cand("b")]).worker
    other = "b" if first == "a" else "a"
    assert policy.choose(turn(NEXT, now=1), [cand(other), cand("c")]).hit_tokens == 0


def test_without_the_index_the_last_turn_still_counts_unless_the_queue_outweighs_it() -> None:
    policy = build_policy("prefix", Random(0))
    first = policy.choose(turn(CONVERSATION), [cand("a"), cand("b")]).worker
    other = "b" if first == "a" else "a"
    blind = RouteQuery(tokens=NEXT, lookup=None, now=1, session="s")
    kept = policy.choose(blind, [cand(first, queued=600), cand(other)])
    assert (kept.worker, kept.hit_tokens, kept.fallback) == (first, 640, "no_lookup")
    moved = policy.choose(blind, [cand(first, queued=5000), cand(other)])
    assert moved.worker == other


def test_sessions_can_be_turned_off() -> None:
    policy = build_policy("prefix", Random(0), prefix=PrefixWeights(session_ttl_secs=None))
    policy.choose(turn(CONVERSATION), [cand("a"), cand("b")])
    assert policy.choose(turn(NEXT, now=1), [cand("a"), cand("b")]).hit_tokens == 0


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
