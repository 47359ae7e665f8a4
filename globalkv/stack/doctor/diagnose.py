"""The walk `globalkv doctor` makes through a live cluster, stage by stage.

Given the gateway, the indexer, or both, it checks what it can reach and marks the rest
as skipped: with only an indexer, prefills are found through the pods it follows; with
only a gateway, the index stage is skipped. The probe needs the gateway; with an indexer
too, it also measures how soon the probe's KV blocks become visible in the index and
whether the repeated probe is served from cache.

Behind Envoy the gateway's part is split: `globalkv epp` chooses (its `/workers`,
`/v1/config` and `/metrics` are read as a gateway's) and answers no request, which enters
at Envoy and reaches a decode's sidecar. `entry` names where requests enter, and the probe
is sent there.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator

from bootstrap.reader import DirectoryReader
from globalkv.stack.doctor.directories import (
    DirectoryCheck,
    DirectoryProbe,
    targets_from_pods,
    targets_from_workers,
)
from globalkv.stack.doctor.index import applied_counts, check_index
from globalkv.stack.doctor.pools import check_pools
from globalkv.stack.doctor.probe import Prober, interpret, probe_text, wait_applied
from globalkv.stack.doctor.reading import Connect, Reader, Samples, tcp_connect
from globalkv.stack.doctor.report import Report, Stage
from globalkv.stack.doctor.routing import (
    check_lookup,
    check_settings,
    judge_decision,
    judge_pd_decision,
)
from globalkv.stack.views import PodsView, WorkersView
from kvplumbing.addresses import check_http_url
from kvplumbing.clock import Clock, Sleep, WallClock


class DoctorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    gateway: str | None = Field(None, description="The gateway's URL.")
    indexer: str | None = Field(None, description="The indexer's URL.")
    entry: str | None = Field(
        None,
        description="Where clients send requests when that is not the gateway: Envoy, in "
        "front of the endpoint picker given as the gateway. The probe is sent there.",
    )
    api_key: str | None = Field(
        None, repr=False, description="The gateway's --api-key, when it has one."
    )
    admin_token: str | None = Field(
        None,
        min_length=1,
        repr=False,
        description="The gateway's --admin-token, for its admin reads when it has no API "
        "key, and the indexer's, for its lookups from another host.",
    )
    timeout: float = Field(5.0, gt=0, description="Seconds for each request or connection.")
    probe: bool = Field(True, description="Send probe requests through the gateway.")
    max_new_tokens: int = Field(4, ge=1, le=1024, description="Tokens each probe generates.")
    freshness_timeout: float = Field(
        5.0, gt=0, description="Seconds the probe's KV events may take to reach the index."
    )

    @field_validator("gateway", "indexer", "entry")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        return None if value is None else check_http_url(value)


def new_report() -> Report:
    return Report(
        [
            Stage("gateway", "gateway worker pools"),
            Stage("directories", "prefill bootstrap directories"),
            Stage("index", "index freshness per pod"),
            Stage("routing", "prefix routing: index and tokenizer"),
            Stage("probe", "probe request: register → resolve → connect → verify-room → consume"),
        ]
    )


class Doctor:
    def __init__(
        self,
        config: DoctorConfig,
        client: httpx.AsyncClient,
        *,
        directory_probe: DirectoryProbe | None = None,
        connect: Connect = tcp_connect,
        clock: Clock = time.monotonic,
        wall: WallClock = time.time,
        sleep: Sleep = asyncio.sleep,
        nonce: str | None = None,
    ) -> None:
        self.config = config
        # The gateway's reads take either; inference takes only the API key.
        token = config.api_key or config.admin_token
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._gateway_reader = Reader(client, timeout=config.timeout, headers=headers)
        self._reader = Reader(client, timeout=config.timeout)
        admin = {"authorization": f"Bearer {config.admin_token}"} if config.admin_token else {}
        self._indexer_reader = Reader(client, timeout=config.timeout, headers=admin)
        self._directories = DirectoryCheck(
            self._reader,
            directory_probe or DirectoryReader(client, timeout=config.timeout),
            connect,
            timeout=config.timeout,
        )
        self._clock = clock
        self._wall = wall
        self._sleep = sleep
        self._nonce = nonce or secrets.token_hex(6)

    async def run(self) -> Report:
        report = new_report()
        config = self.config
        workers: WorkersView | None = None
        pods: PodsView | None = None
        if config.gateway:
            workers = await check_pools(
                report.stage("gateway"), self._gateway_reader, self._reader, config.gateway
            )
        else:
            report.stage("gateway").skip("gateway", "no --gateway given")
        if config.indexer:
            pods = await check_index(
                report.stage("index"), self._indexer_reader, config.indexer, workers, self._wall()
            )
        else:
            report.stage("index").skip("indexer", "no --indexer given")
        targets = (
            targets_from_workers(workers)
            if workers is not None
            else targets_from_pods(pods)
            if pods is not None
            else None
        )
        if targets is None:
            report.stage("directories").skip("prefills", "neither the gateway nor the index read")
        else:
            await self._directories.run(report.stage("directories"), targets)
        routing = report.stage("routing")
        if config.gateway and workers is not None:
            await check_settings(routing, self._gateway_reader, config.gateway, config.indexer)
        if config.indexer:
            await check_lookup(routing, self._indexer_reader, config.indexer, _model(workers, pods))
        if config.gateway and config.probe:
            for pool in _pools(workers):
                await self._probe(report, config.gateway, pods, pool)
        else:
            why = "--no-probe given" if config.gateway else "the probe needs --gateway"
            report.stage("probe").skip("probe", why)
        return report

    async def _samples(self, gateway: str) -> Samples | None:
        samples = await self._gateway_reader.samples(f"{gateway}/metrics")
        return samples if isinstance(samples, Samples) else None

    async def _probe(
        self, report: Report, gateway: str, pods: PodsView | None, pool: ProbedPool
    ) -> None:
        probe = report.stage("probe").labelled(pool.label)
        routing = report.stage("routing").labelled(pool.label)
        prober = Prober(
            self._gateway_reader,
            self.config.entry or gateway,
            max_new_tokens=self.config.max_new_tokens,
            clock=self._clock,
            vllm=pool.vllm,
            model=pool.model,
        )
        text = probe_text(f"{self._nonce}{pool.label}")
        before = await self._samples(gateway)
        response, elapsed = await prober.send(text)
        first = interpret(probe, response, elapsed, vllm=prober.vllm)
        after = await self._samples(gateway)
        delta = after.minus(before) if before is not None and after is not None else None
        if delta is not None:
            _retries(probe, delta)
        if first is None:
            routing.skip("probe routing", "the probe failed; see the probe stage")
            return
        if delta is None:
            routing.warn("probe routing", "the gateway's /metrics could not be read")
        by_index = False
        if delta is not None and not judge_pd_decision(routing, delta, "probe PD decision"):
            by_index = judge_decision(routing, delta, "probe routing")
        if self.config.indexer and pods is not None:
            index = report.stage("index").labelled(pool.label)
            await self._wait_visible(index, self.config.indexer, pods)
        await self._repeat(probe, routing, prober, text, by_index=by_index)

    async def _wait_visible(self, stage: Stage, indexer: str, pods: PodsView) -> None:
        """The probe's KV events must reach the index: the freshness that matters."""
        seen = await wait_applied(
            self._reader,
            indexer,
            applied_counts(pods),
            timeout=self.config.freshness_timeout,
            clock=self._clock,
            sleep=self._sleep,
        )
        if seen is None:
            stage.fail(
                "probe blocks",
                f"no pod's KV events were applied within {self.config.freshness_timeout:.0f}s"
                " of the probe: the index is not learning what the prefills cache",
            )
            return
        (pod, rank), waited = seen
        stage.ok(
            "probe blocks",
            f"applied from pod {pod} dp{rank} within {waited * 1000:.0f} ms of the answer",
        )

    async def _repeat(
        self, probe: Stage, routing: Stage, prober: Prober, text: str, *, by_index: bool
    ) -> None:
        """The same prompt again must be served from the cache the first one left."""
        response, elapsed = await prober.send(text)
        scratch = Stage("repeat", "repeated probe")
        again = interpret(scratch, response, elapsed, vllm=prober.vllm)
        if again is None:
            for failure in scratch.failures:
                probe.fail(f"repeated probe, {failure.subject}", failure.message)
            return
        cached = again.cached_tokens or 0
        message = (
            f"{cached} of {again.prompt_tokens} prompt tokens were cached where it was prefilled"
        )
        if cached > 0:
            routing.ok("repeated probe", f"{message}: it went to the pod holding its prefix")
        elif by_index:
            routing.fail("repeated probe", f"{message}: routing did not follow the cache")
        else:
            routing.warn("repeated probe", f"{message}: the index did not route the probe")


def _retries(stage: Stage, delta: Samples) -> None:
    retried = {
        labels.get("role", "?"): int(value)
        for labels, value in delta.matching("globalkv_gateway_retries_total")
        if value > 0
    }
    if retried:
        sides = ", ".join(f"{n} after a {role} failure" for role, n in sorted(retried.items()))
        stage.warn("retries", f"the gateway retried the probe with a new pair: {sides}")


@dataclass(frozen=True, slots=True)
class ProbedPool:
    vllm: bool
    """Probed through /v1/completions, which vLLM serves, instead of SGLang's /generate."""
    model: str | None
    label: str
    """Before the pool's findings when the gateway serves two pools, else empty."""


def _pools(workers: WorkersView | None) -> list[ProbedPool]:
    """One probe per kind of prefill the gateway pairs. /generate reaches SGLang pairs
    only; the vLLM probe names the model its prefills serve, so that a gateway with an
    SGLang pool and a vLLM pool of different models routes it to the vLLM one (when both
    serve one model, the gateway may answer it from either)."""
    prefills = [w for w in workers.workers if w.role == "prefill"] if workers else []
    vllm = [w for w in prefills if w.kind == "vllm"]
    if not vllm:
        return [ProbedPool(vllm=False, model=None, label="")]
    if len(vllm) == len(prefills):
        return [ProbedPool(vllm=True, model=None, label="")]
    model = next((w.served_model for w in vllm if w.served_model), None)
    return [
        ProbedPool(vllm=False, model=None, label="SGLang pool: "),
        ProbedPool(vllm=True, model=model, label="vLLM pool: "),
    ]


def _model(workers: WorkersView | None, pods: PodsView | None) -> str | None:
    if workers is not None:
        for worker in workers.workers:
            if worker.served_model:
                return worker.served_model
    if pods is not None:
        for pod in pods.pods:
            if pod.model:
                return pod.model
    return None
