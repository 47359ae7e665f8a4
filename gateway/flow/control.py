"""Flow control: when each waiting request is released, and the answers of those refused.

A request enters with its flow (`gateway.flow.keys`), price and route
(`gateway.flow.queues.FlowRequest`) once the gateway knows its tokens and the index's
answer. It goes at once when nothing of its priority or above is waiting (here, or at
another replica sharing its state) and it may start; otherwise it waits in the queues,
and the queues' next request (`FlowQueues.head`: strict priority, then the tenant of least
recent usage) is released as soon as it may start:

- fewer than `--max-concurrent-requests` released requests are not over (each holds its
  place until its answer is over, a stream's at its end);
- a token is in the `--rate-limit-tokens-per-second` bucket, when there is one;
- the prefills have headroom for it (`gateway.flow.headroom`): on some prefill its first
  token within its objective, and room kept for the active objectives above it (its
  grant names those prefills, and the router chooses among them: `Grant.within`);
- no other replica has requests of a higher priority waiting (strict order across the
  replicas sharing their state, as far as their last round of sharing tells).

Nothing else is released while the next one may not start: that is what makes the order
strict and fair. Released requests are charged their prompt tokens to their tenant's
usage. A request waits at most `--queue-timeout-secs` (408); one that does not fit in the
bounded queues, or is shed from them to make room for a request of a higher priority (or
of a tenant waiting less), is answered 429. Every refusal's body says which limit in its
message and its `code`.

Looked at again: when a request arrives, when a released one's answer starts (its
prefill is done) and ends, when the other replicas' state arrives, and when the estimate
that held the next one back says it may go.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import cast

import orjson
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.flow.admission import RateBucket
from gateway.flow.headroom import Headroom, Reserve, Verdict
from gateway.flow.keys import FlowKeys
from gateway.flow.queues import FlowQueues, FlowRequest, RefusalReason, Refused, Waiting
from gateway.flow.usage import Usage
from gateway.http.answer import Answer
from gateway.settings.edge import AdmissionConfig
from gateway.settings.flow import FlowConfig
from kvplumbing.clock import Clock

_WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_LOOK_AGAIN_S = (0.01, 1.0)
"""Bounds of the wait before looking again at a request the estimates hold back."""
_TYPICAL_WEIGHT = 0.1
"""Weight of each request in its objective's typical prompt (an exponential average)."""


@dataclass(slots=True)
class Others:
    """What the other replicas sharing their state last said (`gateway.replicas.shared_flow`)."""

    top: int | None = None
    """The highest priority with requests waiting at any of them."""
    active: Mapping[str, tuple[float, float]] | None = None
    """Objective -> (when its last request came, as this replica's clock reads it; its
    typical prompt tokens)."""


class Grant:
    """A released request's place; `sent` once its load is tracked (the dispatcher took
    it), `started` once its answer starts, `release` once it is over (each idempotent)."""

    __slots__ = ("_flow", "_open", "_placed", "waited", "within")

    def __init__(self, flow: FlowControl, waited: bool, verdict: Verdict | None) -> None:
        self._flow = flow
        self._open = True
        self._placed = _placed(verdict)
        self.waited = waited
        """It waited in the queues (the index may show more of its prompt now)."""
        self.within = None if verdict is None else verdict.within
        """The prefills it was released for (`Verdict.within`; None: any)."""

    def sent(self) -> None:
        placed, self._placed = self._placed, None
        if placed is not None:
            self._flow.unplace(placed)

    def started(self) -> None:
        if self._open:
            self._flow.look()

    def release(self) -> None:
        self.sent()
        if self._open:
            self._open = False
            self._flow.ended()


class FlowControl:
    def __init__(
        self,
        admission: AdmissionConfig,
        config: FlowConfig,
        headroom: Headroom | None,
        clock: Clock,
        registry: CollectorRegistry,
    ) -> None:
        self.config = config
        self.admission = admission
        self.keys = FlowKeys(config)
        self._headroom = headroom
        self._clock = clock
        self.usage = Usage(config.usage_half_life_secs, config.max_tenants, origin=clock())
        self.queues = FlowQueues(admission.queue_size, config.max_queued_bytes, self.usage)
        limit = admission.max_concurrent_requests
        self._limit = limit if limit > 0 else None
        rate = admission.rate_limit_tokens_per_second
        self._bucket = None if rate is None or limit <= 0 else RateBucket(float(limit), rate, clock)
        self.running = 0
        self.placing: dict[str, float] = {}
        """Seconds of work per prefill of the requests released and not yet sent."""
        self._timer: asyncio.TimerHandle | None = None
        self.timed: dict[str, tuple[int, float]] = {
            o.name: (o.priority, o.ttft_s) for o in config.objectives if o.ttft_s is not None
        }
        """Objectives with a TTFT: their priority and TTFT."""
        self.seen: dict[str, tuple[float, float]] = {}
        """Objective with a TTFT -> (its last request's arrival, its typical prompt tokens)."""
        self.others = Others()
        self.refused = Counter(
            "globalkv_gateway_flow_refused",
            "Requests refused by flow control, by reason (queue_full, queue_bytes, tenants, "
            "shed: 429; queue_timeout: 408) and priority.",
            ["reason", "priority"],
            registry=registry,
        )
        self.waits = Histogram(
            "globalkv_gateway_flow_wait_seconds",
            "Time released requests waited in the flow queues, by priority.",
            ["priority"],
            buckets=_WAIT_BUCKETS,
            registry=registry,
        )
        self._waits: dict[int, Histogram] = {}
        registry.register(_FlowCollector(self))

    async def enter(
        self, request: FlowRequest, waiting: Callable[[], Awaitable[None]] | None = None
    ) -> Grant | Answer:
        """The request's place once it may start, or the refusal to answer. `waiting` is
        awaited once the request waits in the queues instead of starting at once (the
        picker tells its data plane to wait longer)."""
        now = self._clock()
        self._note(request, now)
        if self._free_above(request.key.priority):
            verdict = self._verdict(request)
            if verdict is None or verdict.late_s == 0:
                self._start(request, now, 0.0, verdict)
                return Grant(self, False, verdict)
        outcome: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        queued = Waiting(request, now, outcome)
        try:
            shed = self.queues.add(queued)
        except Refused as refused:
            return self._refusal(refused.reason, request)
        for victim in shed:
            victim.outcome.set_result("shed")
        self.look()
        try:
            async with asyncio.timeout(self.admission.queue_timeout_secs):
                if waiting is not None and not outcome.done():
                    await waiting()
                reason = await asyncio.shield(outcome)
        except TimeoutError:
            if self.queues.remove(queued):
                self.look()  # it may have held back the rest
                return self._refusal("queue_timeout", request)
            reason = outcome.result()  # decided as the timeout fired
        except BaseException:  # the client left, or telling it failed
            if self.queues.remove(queued):
                self.look()
            elif outcome.done() and not isinstance(outcome.result(), str):
                Grant(self, True, _released(outcome.result())).release()
            raise
        if isinstance(reason, str):
            return self._refusal(cast(RefusalReason, reason), request)
        return Grant(self, True, _released(reason))

    def look(self) -> None:
        """Release every request that may start now, in order; when the next may not, look
        again when the estimates say it may."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        queues = self.queues
        while (head := queues.head()) is not None:
            if not self._free_above(head.priority + 1):
                return  # another replica's higher priority goes first; its next round says when
            verdict = self._verdict(head.request)
            if verdict is not None and verdict.late_s > 0:
                if verdict.late_s < math.inf:
                    low, high = _LOOK_AGAIN_S
                    delay = min(max(verdict.late_s, low), high)
                    self._timer = asyncio.get_running_loop().call_later(delay, self.look)
                return
            queues.remove(head)
            now = self._clock()
            self._start(head.request, now, now - head.arrived, verdict)
            head.outcome.set_result(verdict)

    def ended(self) -> None:
        self.running -= 1
        self.look()

    def unplace(self, placed: Verdict) -> None:
        assert placed.prefill is not None
        left = self.placing.get(placed.prefill, 0.0) - placed.work_s
        if left > 1e-9:
            self.placing[placed.prefill] = left
        else:
            self.placing.pop(placed.prefill, None)

    def _start(
        self, request: FlowRequest, now: float, waited: float, verdict: Verdict | None
    ) -> None:
        """The request released: its place taken, its tenant charged, and where the
        headroom placed it counted until it is sent (its grant's `sent`)."""
        self.running += 1
        if self._bucket is not None:
            self._bucket.take()
        self.usage.charge(request.key.tenant, request.tokens, now)
        priority = request.key.priority
        waits = self._waits.get(priority)
        if waits is None:  # one child per priority, bound once: priorities are configured
            waits = self._waits[priority] = self.waits.labels(str(priority))
        waits.observe(waited)
        placed = _placed(verdict)
        if placed is not None:
            assert placed.prefill is not None
            self.placing[placed.prefill] = self.placing.get(placed.prefill, 0.0) + placed.work_s

    def _free_above(self, priority: int) -> bool:
        """Nothing waits here or at another replica at `priority` or above."""
        top = self.queues.top()
        if top is not None and top >= priority:
            return False
        return self.others.top is None or self.others.top < priority

    def _verdict(self, request: FlowRequest) -> Verdict | None:
        """None when nothing holds `request` back; otherwise whether it may go now (a
        `late_s` of 0) or in how many seconds (infinite: not before a request ends), and
        where the headroom places it."""
        if self._limit is not None and self.running >= self._limit:
            return Verdict(math.inf)
        if self._bucket is not None and self._bucket.tokens < 1:
            return Verdict(self._bucket.wait_s())
        if self._headroom is None:
            return None
        reserves = self._reserves(request.key.priority, request.key.objective)
        if request.key.ttft_s is None and not reserves:
            return None
        return self._headroom.assess(request, reserves, self.placing)

    def _note(self, request: FlowRequest, now: float) -> None:
        """An arrival of an objective with a TTFT keeps its headroom for a while."""
        name = request.key.objective
        if name not in self.timed:
            return
        _, typical = self.seen.get(name, (now, float(request.tokens)))
        typical += _TYPICAL_WEIGHT * (request.tokens - typical)
        self.seen[name] = (now, typical)

    def _reserves(self, priority: int, objective: str) -> list[Reserve]:
        """The active objectives above `priority`, with a TTFT."""
        now = self._clock()
        horizon = now - self.config.reserve_secs
        others = self.others.active or {}
        reserves = []
        for name, (above, ttft_s) in self.timed.items():
            if above <= priority or name == objective:
                continue
            last, tokens = self.seen.get(name, (-math.inf, 0.0))
            elsewhere = others.get(name)
            if elsewhere is not None and elsewhere[0] > last:
                last, tokens = elsewhere[0], max(tokens, elsewhere[1])
            if last >= horizon or self.queues.has(above) or self._others_wait(above):
                reserves.append(Reserve(ttft_s, tokens, self.config.reserve_prefills))
        return reserves

    def _others_wait(self, priority: int) -> bool:
        return self.others.top is not None and self.others.top >= priority

    def _refusal(self, reason: RefusalReason, request: FlowRequest) -> Answer:
        self.refused.labels(reason, str(request.key.priority)).inc()
        admission, config = self.admission, self.config
        messages = {
            "queue_full": f"too many requests: the flow queues hold {admission.queue_size} "
            "requests (--queue-size), none of a lower priority or of a tenant holding more",
            "queue_bytes": f"too many requests: the flow queues hold {config.max_queued_bytes} "
            "bytes of requests (--flow-max-queued-bytes), none of a lower priority or of a "
            "tenant holding more",
            "tenants": f"too many tenants: {config.max_tenants} tenants have requests waiting "
            "(--flow-max-tenants)",
            "shed": "shed: the flow queues were full (--queue-size, --flow-max-queued-bytes) "
            "and a request of a higher priority, or of a tenant holding fewer, took this "
            "one's place",
            "queue_timeout": f"request waited {admission.queue_timeout_secs:g} s in the flow "
            "queues (--queue-timeout-secs) without the prefills having room for it",
        }
        kind = "request_timeout" if reason == "queue_timeout" else "rate_limit_exceeded"
        error = {"message": messages[reason], "type": kind, "param": None, "code": reason}
        body = orjson.dumps({"error": error})
        if reason == "queue_timeout":
            return Answer(408, body)
        return Answer(429, body, headers=(("retry-after", "1"),))


def _placed(verdict: Verdict | None) -> Verdict | None:
    """The placement a release carries, when the headroom made one."""
    if verdict is not None and verdict.prefill is not None:
        return verdict
    return None


def _released(outcome: object) -> Verdict | None:
    """A waiting request's release, as its outcome holds it."""
    return outcome if isinstance(outcome, Verdict) else None


class _FlowCollector(Collector):
    """The queues' state, read at scrape time."""

    def __init__(self, flow: FlowControl) -> None:
        self._flow = flow

    def collect(self) -> Iterator[Metric]:
        flow = self._flow
        queued = GaugeMetricFamily(
            "globalkv_gateway_flow_queued",
            "Requests waiting in the flow queues, by priority.",
            labels=["priority"],
        )
        for priority, count in sorted(flow.queues.occupancy().items()):
            queued.add_metric([str(priority)], float(count))
        yield queued
        yield GaugeMetricFamily(
            "globalkv_gateway_flow_queued_bytes",
            "Bytes of the requests waiting in the flow queues.",
            value=float(flow.queues.bytes),
        )
        yield GaugeMetricFamily(
            "globalkv_gateway_flow_running",
            "Requests released by flow control whose answer is not over.",
            value=float(flow.running),
        )
        yield GaugeMetricFamily(
            "globalkv_gateway_flow_tenants",
            "Tenants whose usage flow control keeps.",
            value=float(len(flow.usage)),
        )
        yield CounterMetricFamily(
            "globalkv_gateway_flow_unknown_objectives",
            "Requests naming an objective that is not configured (given the default one).",
            value=float(flow.keys.unknown),
        )
