"""The discrete-event replay: the gateway's policy chooses, simulated pods serve.

Per request, in the order the gateway does it (`gateway.router.Router`, `gateway.dispatch`):
the prompt is looked up in the real `MemoryIndex` (only for a policy that uses the index,
as `Router.uses_index` decides), the policy object built by `gateway.policies.build_policy`
chooses a prefill among `LoadTracker` candidates and the decode policy a decode, and the
load is started with the policy's own estimate of the uncached tokens. The prefill pod
then matches, queues, computes and inserts (`bench.replay.pods`); its KV events reach the
index `event_delay_s` later; the prefill's load ends when it answers (compute + KV
transfer) and the decode's when the last output token is out.

Requests arriving at the same instant are all admitted before an idle pod plans its next
step (a `_KICK` at that instant), as the engine's loop batches what arrived while it
slept. Simulated time runs in wall seconds of the configured `time_scale`, the clock a live run
has, so the policies see the same `now`; the record converts back to trace seconds.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from random import Random

from bench.replay.config import ReplaySettings, ResolvedCluster
from bench.replay.pods import Finished, PrefillPod, StepModel
from bench.replay.record import Progress, ProgressHook, RunRecord
from bench.replay.tokens import expand
from bench.replay.trace import Trace, arrival_times
from enginesim.kvcache import PagedKVCache
from gateway.config import PolicyName
from gateway.policies import LoadTicket, LoadTracker, Policy, RouteRequest, build_policy
from gateway.policies.pending import PendingPrefixes
from globalkv.index.base import ApplyResult, SourceBatch
from globalkv.index.memory import MemoryIndex
from globalkv.lookup import IndexLookup

_INDEX, _KICK, _STEP, _ANSWERED, _DECODED = range(5)


def prefill_names(count: int) -> list[str]:
    return [f"prefill-{i}" for i in range(count)]


def decode_names(count: int) -> list[str]:
    return [f"decode-{i}" for i in range(count)]


def index_counts(totals: ApplyResult) -> dict[str, int]:
    return {
        "stored": totals.stored,
        "removed": totals.removed,
        "orphans": totals.orphans,
        "partial": totals.partial,
        "over_capacity": totals.over_capacity,
        "invalid": totals.invalid,
    }


def make_policies(settings: ReplaySettings, name: PolicyName) -> tuple[Policy, Policy]:
    """The gateway's own objects, built as `gateway.service.build_gateway` builds them:
    prefill and decode policy share one RNG seeded with the gateway's `--seed`, so a live
    gateway given the same seed and candidates draws the same choices."""
    rng = Random(settings.seed)
    prefill = build_policy(name, rng, prefix=settings.prefix, cache_aware=settings.cache_aware)
    decode = build_policy(settings.decode_policy, rng)
    return prefill, decode


@dataclass(slots=True)
class _InFlight:
    prefill: LoadTicket
    decode: LoadTicket
    output_length: int


@dataclass(slots=True)
class Simulation:
    """One policy over one trace; `run()` replays it and returns the record."""

    trace: Trace
    settings: ReplaySettings
    cluster: ResolvedCluster
    policy_name: PolicyName
    progress: ProgressHook | None = None
    index: MemoryIndex = field(init=False)
    pods: dict[str, PrefillPod] = field(init=False)
    apply_totals: ApplyResult = field(init=False, default_factory=ApplyResult)

    def __post_init__(self) -> None:
        c, scale = self.cluster, self.settings.time_scale
        model = StepModel(
            tokens_per_s=c.prefill_tokens_per_s / scale,
            overhead_s=c.prefill_overhead_s * scale,
            max_batch_tokens=c.max_batch_tokens,
            attention_tokens=c.attention_tokens,
        )
        self.index = MemoryIndex(c.block_size)
        self.pods = {
            name: PrefillPod(
                name,
                PagedKVCache(c.block_size, c.capacity_blocks),
                model,
                index_model=self.settings.model,
            )
            for name in prefill_names(c.pods)
        }

    async def run(self) -> RunRecord:
        settings, c, scale = self.settings, self.cluster, self.settings.time_scale
        policy, decode_policy = make_policies(settings, self.policy_name)
        clock = [0.0]
        grace = settings.prefix.pending_grace_secs
        loads = LoadTracker(
            pending=None if grace is None else PendingPrefixes(grace * scale),
            clock=lambda: clock[0],
        )
        lookup = IndexLookup(self.index)
        uses_index = policy.name == "prefix"
        requests = self.trace.requests
        arrivals = [t * scale for t in arrival_times(requests, settings.arrivals)]
        record = RunRecord.empty(self.policy_name, len(requests), scale)
        prefills, decodes = list(self.pods), decode_names(c.decode_pods)
        transfer_rate = (
            None if c.kv_transfer_tokens_per_s is None else c.kv_transfer_tokens_per_s / scale
        )
        decode_interval = scale / c.decode_tokens_per_s
        delay = c.event_delay_s * scale
        events: list[tuple[float, int, int, object]] = []
        order = itertools.count()
        flights: dict[int, _InFlight] = {}
        started_wall = time.perf_counter()

        def push(at: float, kind: int, payload: object) -> None:
            heapq.heappush(events, (at, kind, next(order), payload))

        async def deliver(batch: SourceBatch) -> None:
            result = await self.index.apply(batch)
            totals = self.apply_totals
            totals.stored += result.stored
            totals.removed += result.removed
            totals.orphans += result.orphans
            totals.partial += result.partial
            totals.over_capacity += result.over_capacity
            totals.invalid += result.invalid

        async def finished(done: Finished) -> None:
            job, end = done.job, done.end
            if done.batch is not None:
                if delay == 0:
                    await deliver(done.batch)
                else:
                    push(end + delay, _INDEX, done.batch)
            flight = flights[job.request]
            transfer = 0.0 if transfer_rate is None else len(job.tokens) / transfer_rate
            assert job.started is not None
            record.served(
                job.request,
                cached=job.cached,
                queue=job.started - job.arrived,
                prefill=end - job.started,
                ttft=end + transfer - job.arrived,
            )
            push(end + transfer, _ANSWERED, job.request)
            last_token = max(flight.output_length - 1, 0) * decode_interval
            push(end + transfer + last_token, _DECODED, job.request)

        async def step_end(pod: PrefillPod, now: float) -> None:
            for done in pod.end_step(now):
                await finished(done)
            following = pod.start_step(now)
            if following is not None:
                push(following, _STEP, pod)

        async def arrive(i: int, now: float) -> None:
            req = requests[i]
            tokens = expand(req.hash_ids, req.input_length, c.block_size, settings.vocab)
            answer = await lookup.lookup(settings.model, tokens) if uses_index else None
            keys = () if answer is None else answer.keys
            request = RouteRequest(
                tokens=tokens, lookup=answer, now=now, pending=loads.pending_blocks(keys)
            )
            choice = policy.choose(request, loads.candidates(prefills))
            decode = decode_policy.choose(request, loads.candidates(decodes)).worker
            flights[i] = _InFlight(
                loads.start(
                    choice.worker, choice.uncached_tokens, keys, cached_tokens=choice.hit_tokens
                ),
                loads.start(decode),
                settings.output_tokens(req.output_length),
            )
            indexed = (
                None if answer is None else max((p.hit_tokens for p in answer.pods), default=0)
            )
            record.routed(
                i,
                now,
                choice,
                tokens=len(tokens),
                output=flights[i].output_length,
                indexed_hit=indexed,
            )
            pod = self.pods[choice.worker]
            pod.admit(i, tokens, now)
            push(now, _KICK, pod)

        next_arrival = 0
        total = len(arrivals)
        while next_arrival < total or events:
            if next_arrival < total and (not events or arrivals[next_arrival] <= events[0][0]):
                clock[0] = arrivals[next_arrival]
                await arrive(next_arrival, arrivals[next_arrival])
                next_arrival += 1
                if self.progress is not None and next_arrival % 250 == 0:
                    self.progress(self._progress(next_arrival, total, started_wall, arrivals))
                continue
            now, kind, _, payload = heapq.heappop(events)
            clock[0] = now
            if kind == _INDEX:
                assert isinstance(payload, SourceBatch)
                await deliver(payload)
            elif kind == _KICK:
                assert isinstance(payload, PrefillPod)
                end = payload.start_step(now)
                if end is not None:
                    push(end, _STEP, payload)
            elif kind == _STEP:
                assert isinstance(payload, PrefillPod)
                await step_end(payload, now)
            elif kind == _ANSWERED:
                assert isinstance(payload, int)
                loads.finish(flights[payload].prefill)
            else:
                assert isinstance(payload, int)
                flight = flights.pop(payload)
                loads.finish(flight.decode)
                record.decoded(payload, now)
        record.close(
            [pod.stats() for pod in self.pods.values()],
            index_counts(self.apply_totals),
            wall_s=time.perf_counter() - started_wall,
        )
        if self.progress is not None:
            self.progress(self._progress(total, total, started_wall, arrivals))
        return record

    def _progress(
        self, done: int, total: int, started: float, arrivals: Sequence[float]
    ) -> Progress:
        sim_now = arrivals[done - 1] / self.settings.time_scale if done else 0.0
        return Progress(self.policy_name, done, total, sim_now, time.perf_counter() - started)
