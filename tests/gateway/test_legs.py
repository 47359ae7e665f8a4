"""The legs behind one interface: the dispatcher retries whatever legs a pair's kind names,
and the legs run on a pair chosen by anyone (fake workers, fake clock)."""

from __future__ import annotations

import math
from collections.abc import Collection
from random import Random
from typing import Any

from gateway.http.answer import Answer, problem
from gateway.legs.attempt import Attempt, Failure
from gateway.legs.deadline import Progress
from gateway.legs.dispatch import Dispatcher
from gateway.legs.retry import RetrySchedule
from gateway.legs.sglang import DualLegs
from gateway.legs.vllm import SequentialLegs
from gateway.policies.base import Choice
from gateway.requests.bodies import parse_request
from gateway.requests.query import RouteQuery
from gateway.requests.request import Request
from gateway.routing.plan import RoutePlan
from gateway.serving.service import Gateway
from gateway.settings.workers import RetryConfig
from tests.gateway.fakes import DECODES, PREFILLS, Cluster, config, make_gateway, request_of, sample
from tests.gateway.test_dispatch import host
from tests.support.clock import RecordedSleep


def _plan(gateway: Gateway, prefill: str, decode: str) -> RoutePlan:
    p, d = gateway.pool.get(host(prefill)), gateway.pool.get(host(decode))
    assert p is not None
    assert d is not None
    return RoutePlan(p, d, Choice(p.id), [42])


class _PairsInTurn:
    """A chooser handing out pairs of the fake cluster in turn, recording what it was asked."""

    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway
        self.avoided: list[set[str]] = []

    def plan(self, query: RouteQuery, avoid: Collection[str] = ()) -> RoutePlan:
        self.avoided.append(set(avoid))
        turn = len(self.avoided) - 1
        return _plan(self._gateway, PREFILLS[turn % 2], DECODES[turn % 2])


class _ScriptedLegs:
    """Legs that fail retryably until their last attempt, then answer."""

    def __init__(self) -> None:
        self.attempts: list[tuple[int, bool, str]] = []

    async def run(self, request: Request, plan: RoutePlan, attempt: Attempt) -> Answer | Failure:
        self.attempts.append((attempt.number, attempt.final, plan.prefill.id))
        if not attempt.final:
            return Failure("prefill", plan.prefill, True, problem(502, "not yet"))
        return Answer(200, b'{"text": "ok"}')


async def test_the_dispatcher_retries_on_new_pairs_through_the_legs_of_the_pairs_kind() -> None:
    gateway = await make_gateway(Cluster(), config())
    chooser, legs = _PairsInTurn(gateway), _ScriptedLegs()
    retries = RetrySchedule(RetryConfig(max_retries=3), Random(0))
    sleeps = RecordedSleep()
    dispatcher = Dispatcher(
        chooser, {"sglang": legs}, retries, gateway.metrics, timeout=60.0, sleep=sleeps
    )
    parsed = parse_request("generate", {"input_ids": [1, 2]})
    answer = await dispatcher.forward(request_of(parsed, RouteQuery([1, 2])))
    assert (answer.status, answer.body) == (200, b'{"text": "ok"}')
    first, second = host(PREFILLS[0]), host(PREFILLS[1])
    assert legs.attempts == [(0, False, first), (1, False, second), (2, True, first)]
    assert chooser.avoided == [set(), {first}, {first, second}]
    assert len(sleeps.delays) == 2, "a pause before each retry"


async def _run(
    legs: Any, gateway: Gateway, body: dict[str, Any], endpoint: Any
) -> Answer | Failure:
    """One attempt of `legs` on a pair chosen by hand: no router, no dispatcher."""
    request = request_of(parse_request(endpoint, body))
    plan = _plan(gateway, PREFILLS[1], DECODES[0])
    attempt = Attempt(0, True, Progress(math.inf, None))
    outcome = await legs.run(request, plan, attempt)
    await gateway.calls.drain()
    return outcome


async def test_sglang_legs_run_on_a_pair_chosen_elsewhere() -> None:
    cluster = Cluster()
    gateway = await make_gateway(cluster)
    outcome = await _run(DualLegs(gateway.calls), gateway, {"input_ids": [1, 2]}, "generate")
    assert isinstance(outcome, Answer)
    assert outcome.status == 200
    (prefill,), (decode,) = cluster.inference("prefill"), cluster.inference("decode")
    assert (prefill.worker, decode.worker) == (host(PREFILLS[1]), host(DECODES[0]))
    assert prefill.body == decode.body
    assert decode.body["bootstrap_room"] == 42
    assert all(v.in_flight == 0 for v in gateway.loads.loads.values())


async def test_vllm_legs_fail_without_a_decode_when_the_prefill_fails() -> None:
    cluster = Cluster()
    cluster.down.add(host(PREFILLS[1]))
    gateway = await make_gateway(cluster)
    legs = SequentialLegs(gateway.calls, gateway.metrics, allow_recompute=False)
    outcome = await _run(legs, gateway, {"prompt": "hi"}, "completions")
    assert isinstance(outcome, Failure)
    assert (outcome.role, outcome.retryable, outcome.answer.status) == ("prefill", True, 502)
    assert cluster.inference("decode") == []
    failures = "globalkv_gateway_upstream_failures_total"
    assert sample(gateway, failures, role="prefill", reason="ConnectError") == 1
