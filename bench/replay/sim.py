"""The discrete-event replay: the gateway's policy chooses, simulated pods serve.

Per request, in the order the gateway does it (`gateway.routing.router.Router`,
`gateway.legs.dispatch`): the prompt is looked up in the real `MemoryIndex` (only for a
policy that uses the index, as `Policy.uses_index` says), the policy object built by
`gateway.policies.build_policy` chooses a prefill among `LoadTracker` candidates and the
decode policy a decode, and the load is started with the policy's own estimate of the
uncached tokens. The prefill pod then matches, queues, computes and inserts
(`bench.replay.pods`); its KV events reach the index `event_delay_s` later; the prefill's
load ends when it answers (compute + KV transfer) and the decode's when the last output
token is out.

Requests arriving at the same instant are all admitted before an idle pod plans its next
step (a kick at that instant), as the engine's loop batches what arrived while it
slept. Simulated time runs in wall seconds of the configured `time_scale`, the clock a live run
has, so the policies see the same `now`; the record converts back to trace seconds.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from random import Random

from bench.replay.config import ReplaySettings, ResolvedCluster
from bench.replay.decodes import DecodePod, isl_bounding
from bench.replay.events import EventKind, EventQueue, InFlight, Rates, SimClock
from bench.replay.pods import Finished, PrefillPod, StepModel
from bench.replay.record import Progress, ProgressHook, RunRecord
from bench.replay.tokens import expand
from bench.replay.trace import Trace, arrival_times, conversation
from enginesim.kvcache import PagedKVCache
from gateway.load.held import held_prefixes
from gateway.load.pending import PendingPrefixes
from gateway.load.tracker import Candidate, LoadTracker
from gateway.policies import Choice, Policy, build_policy
from gateway.requests.query import RouteQuery
from gateway.routing.decider import PdDecider
from gateway.settings.base import PolicyName
from gateway.settings.routing import PdDeciderConfig
from globalkv.index.base import ApplyResult, SourceBatch
from globalkv.index.memory import MemoryIndex
from globalkv.lookup import IndexLookup


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
    """The gateway's own objects, built as `gateway.serving.service.build_gateway` builds them:
    prefill and decode policy share one RNG seeded with the gateway's `--seed`, so a live
    gateway given the same seed and candidates draws the same choices."""
    rng = Random(settings.seed)
    prefill = build_policy(name, rng, prefix=settings.prefix, cache_aware=settings.cache_aware)
    decode = build_policy(settings.decode_policy, rng)
    return prefill, decode


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
    decode_pods: dict[str, DecodePod] = field(init=False)
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
        interval = scale / c.decode_tokens_per_s
        self.decode_pods = {
            name: DecodePod(
                name,
                PrefillPod(
                    name,
                    PagedKVCache(c.block_size, c.capacity_blocks),
                    model,
                    index_model=self.settings.model,
                ),
                interval,
            )
            for name in decode_names(c.decode_pods)
        }
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
        replay = Run(self, time.perf_counter())
        await replay.run_to_end()
        self.report_progress(replay.total, replay)
        return replay.record

    def report_progress(self, done: int, replay: Run) -> None:
        if self.progress is None:
            return
        arrivals = replay.arrivals
        sim_now = arrivals[done - 1] / self.settings.time_scale if done else 0.0
        wall = time.perf_counter() - replay.started_wall
        self.progress(Progress(self.policy_name, done, replay.total, sim_now, wall))


class Run:
    """The state of one replay: the gateway's objects, the pods' events, the record."""

    def __init__(self, sim: Simulation, started_wall: float) -> None:
        settings, c, scale = sim.settings, sim.cluster, sim.settings.time_scale
        self.sim, self.settings, self.started_wall = sim, settings, started_wall
        self.policy, self.decode_policy = make_policies(settings, sim.policy_name)
        self.clock = SimClock()
        grace = settings.prefix.pending_grace_secs
        self.loads = LoadTracker(
            pending=None if grace is None else PendingPrefixes(grace * scale),
            clock=self.clock.read,
        )
        self.lookup = IndexLookup(sim.index)
        self.deciding = settings.pd_decider != "always"
        self.uses_index = self.policy.uses_index or self.deciding
        transfer = c.kv_transfer_tokens_per_s
        self.decider = PdDecider(
            PdDeciderConfig(
                mode="local-when-faster",
                itl_weight=settings.pd_decider_itl_weight,
                **({} if transfer is None else {"transfer_tokens_per_s": transfer / scale}),
            )
        )
        self.requests = sim.trace.requests
        self.arrivals = [t * scale for t in arrival_times(self.requests, settings.arrivals)]
        self.total = len(self.arrivals)
        self.record = RunRecord.empty(sim.policy_name, len(self.requests), scale)
        self.record.interval = scale / c.decode_tokens_per_s
        self.prefills, self.decodes = list(sim.pods), decode_names(c.decode_pods)
        # What each emulated prefill reports in /server_info: its pages times their size.
        self.capacities = {name: c.capacity_blocks * c.block_size for name in self.prefills}
        self.rates = Rates.of(c, scale)
        self.events = EventQueue()
        self.flights: dict[int, InFlight] = {}

    async def run_to_end(self) -> None:
        """Arrivals and events in time order; an arrival goes before events at its instant."""
        next_arrival, events = 0, self.events
        while next_arrival < self.total or events:
            if next_arrival < self.total and (
                not events or self.arrivals[next_arrival] <= events.next_at()
            ):
                self.clock.now = self.arrivals[next_arrival]
                await self.arrive(next_arrival, self.clock.now)
                next_arrival += 1
                if next_arrival % 250 == 0:
                    self.sim.report_progress(next_arrival, self)
                continue
            now, kind, payload = events.pop()
            self.clock.now = now
            await self.handle(now, kind, payload)
        self.record.close(
            [pod.stats() for pod in self.sim.pods.values()],
            index_counts(self.sim.apply_totals),
            wall_s=time.perf_counter() - self.started_wall,
        )

    async def handle(self, now: float, kind: EventKind, payload: object) -> None:
        if kind is EventKind.INDEX:
            assert isinstance(payload, SourceBatch)
            await self.deliver(payload)
        elif kind is EventKind.KICK:
            assert isinstance(payload, PrefillPod)
            self.start_step(payload, now)
        elif kind is EventKind.STEP_END:
            assert isinstance(payload, PrefillPod)
            await self.step_end(payload, now)
        elif kind is EventKind.ANSWERED:
            assert isinstance(payload, int)
            if self.deciding:
                await self.first_token(payload, now)
            else:
                self.loads.finish(self.flights[payload].prefill)
        elif kind is EventKind.DECODE_END:
            assert isinstance(payload, tuple)
            i, at = payload
            if self.flights[i].decoded_at == at:
                flight = self.flights.pop(i)
                decoding = self.sim.decode_pods[flight.decode_pod].finish(i)
                self.record.stretched[i] = decoding.stretched
                self.loads.finish(flight.decode)
                self.record.decoded(i, now)
        else:
            assert isinstance(payload, int)
            flight = self.flights.pop(payload)
            self.loads.finish(flight.decode)
            self.record.decoded(payload, now)

    async def arrive(self, i: int, now: float) -> None:
        """Route request `i` as the gateway does and admit it to the chosen prefill."""
        req, settings = self.requests[i], self.settings
        tokens = expand(req.hash_ids, req.input_length, self.sim.cluster.block_size, settings.vocab)
        answer = await self.lookup.lookup(settings.model, tokens) if self.uses_index else None
        keys = () if answer is None else answer.keys
        request = RouteQuery(
            tokens=tokens,
            lookup=answer,
            now=now,
            pending=self.loads.pending_blocks(keys),
            session=conversation(req) if settings.sessions else None,
        )
        prefills = self.loads.candidates(self.prefills, self.capacities)
        local = self.local_choice(request, prefills) if self.deciding else None
        if local is not None:
            self.admit_local(i, now, local, tokens, keys)
            return
        choice = self.policy.choose(request, prefills)
        decode = self.decode_policy.choose(request, self.loads.candidates(self.decodes)).worker
        flight = InFlight(
            self.loads.start_prefill(choice, keys),
            self.loads.start_decode(decode),
            settings.output_tokens(req.output_length),
            decode,
            tokens,
        )
        self.flights[i] = flight
        indexed = None if answer is None else max((p.hit_tokens for p in answer.pods), default=0)
        self.record.routed(
            i, now, choice, tokens=len(tokens), output=flight.output_length, indexed_hit=indexed
        )
        pod = self.sim.pods[choice.worker]
        pod.admit(i, tokens, now)
        self.events.push(now, EventKind.KICK, pod)

    def local_choice(self, request: RouteQuery, prefills: list[Candidate]) -> Choice | None:
        """The decode pod that prefills the request itself, by the gateway's decider or
        by Dynamo's isl_bounding rule on the decode holding the longest prefix; None:
        disaggregate."""
        decodes = self.loads.candidates(self.decodes)
        lookup = request.lookup
        if self.settings.pd_decider == "local-when-faster":
            decision = self.decider.decide(
                request, prefills, decodes, lambda w: self.loads.load(w).progress.tokens_per_s
            )
            return decision.choice if decision.local else None
        if lookup is None:
            return None
        hits = held_prefixes(lookup, decodes, request.pending)
        candidate, hit, dp_rank = max(hits, key=lambda h: (h[1], -h[0].in_flight))
        prompt = request.prompt_tokens
        if not isl_bounding(prompt, hit):
            return None
        held = min(hit, prompt)
        return Choice(candidate.worker, dp_rank, held, prompt - held)

    def admit_local(
        self, i: int, now: float, choice: Choice, tokens: Sequence[int], keys: Sequence[int]
    ) -> None:
        ticket = self.loads.start_prefill(choice, keys)
        output = self.settings.output_tokens(self.requests[i].output_length)
        self.flights[i] = InFlight(ticket, ticket, output, choice.worker, tokens, local=True)
        self.record.routed(i, now, choice, tokens=len(tokens), output=output)
        self.record.local[i] = True
        pod = self.sim.decode_pods[choice.worker].prefill
        pod.admit(i, tokens, now)
        self.events.push(now, EventKind.KICK, pod)

    async def first_token(self, i: int, now: float) -> None:
        """The request's first token is out (its prefill answered, its KV moved to the
        decode pod, which keeps it): the decode pod starts emitting the rest."""
        flight = self.flights[i]
        decode = self.sim.decode_pods[flight.decode_pod]
        if flight.local:
            self.loads.prefill_done(flight.prefill)
        else:
            self.loads.finish(flight.prefill)
            batch = decode.prefill.store(flight.tokens, now)
            if batch is not None:
                self.events.push(now + self.rates.event_delay_s, EventKind.INDEX, batch)
        self.schedule_end(i, decode.start(i, now, flight.output_length))

    def schedule_end(self, i: int, at: float) -> None:
        self.flights[i].decoded_at = at
        self.events.push(at, EventKind.DECODE_END, (i, at))

    def start_step(self, pod: PrefillPod, now: float) -> None:
        end = pod.start_step(now)
        if end is None:
            return
        self.events.push(end, EventKind.STEP_END, pod)
        decode = self.sim.decode_pods.get(pod.name)
        if decode is not None:
            for request, moved in decode.stall(now, end).items():
                self.schedule_end(request, moved)

    async def step_end(self, pod: PrefillPod, now: float) -> None:
        for done in pod.end_step(now):
            await self.finished(done)
        self.start_step(pod, now)

    async def finished(self, done: Finished) -> None:
        """A prompt's prefill is over: its events go to the index, its answer and last
        token are scheduled."""
        job, end = done.job, done.end
        if done.batch is not None:
            if self.rates.event_delay_s == 0:
                await self.deliver(done.batch)
            else:
                self.events.push(end + self.rates.event_delay_s, EventKind.INDEX, done.batch)
        flight = self.flights[job.request]
        transfer = 0.0 if flight.local else self.rates.transfer_s(len(job.tokens))
        assert job.started is not None
        self.record.served(
            job.request,
            cached=job.cached,
            queue=job.started - job.arrived,
            prefill=end - job.started,
            ttft=end + transfer - job.arrived,
        )
        self.events.push(end + transfer, EventKind.ANSWERED, job.request)
        if self.deciding:
            return
        last_token = max(flight.output_length - 1, 0) * self.rates.decode_interval_s
        self.events.push(end + transfer + last_token, EventKind.DECODED, job.request)

    async def deliver(self, batch: SourceBatch) -> None:
        result = await self.sim.index.apply(batch)
        totals = self.sim.apply_totals
        totals.stored += result.stored
        totals.removed += result.removed
        totals.orphans += result.orphans
        totals.partial += result.partial
        totals.over_capacity += result.over_capacity
        totals.invalid += result.invalid
