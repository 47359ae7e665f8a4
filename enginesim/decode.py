"""The decode role: find the room's producer, pull its KV, verify the room, generate.

A prompt walks the PD stages of `docs/architecture.md` ("Read path"), each timed into
`meta_info.pd_stages_ms` and `globalkv_engine_pd_stage_seconds{stage}`:

- `register`: the prefill's directory answers with its topology, which it only does once
  every rank registered (SGLang's readiness gate: registration seen and topology read
  arrive in the same answer, so they are one measurement);
- `rank`: target ranks computed, the prefill DP rank chosen, rank addresses looked up
  (through `bootstrap.resolver`, cached per address);
- `connect`: every target rank acknowledged this room's request;
- `transfer`: every target rank sent its KV-ready message;
- `room`: the metadata room checked (0 → not ready, another → `bootstrap_room mismatch`);
- `consume`: the tokens generated and streamed.

A failure names its stage: those above, or `topology` (invalid snapshot, layouts that
cannot pair) and `dp_rank` (the room's DP rank never registered) from the resolver.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from bootstrap.resolver import DecodeResolver, DecodeTopology, ResolvedProducer, ResolveError
from enginesim.config import EngineConfig
from enginesim.engine import Bootstrap, EngineError, Generation, Prompt
from enginesim.faults import Faults
from enginesim.handshake import KVMetadata, RankId
from enginesim.latency import DecodeStalls, paced
from enginesim.metrics import EngineMetrics
from enginesim.prefill import DPRank
from enginesim.publisher import describe_kv_events
from enginesim.textgen import ReplyWriter
from enginesim.transfer import DecodeTransfer, TransferError
from enginesim.vllm import VllmDecode
from kvplumbing.clock import Clock

_MAX_KNOWN_URLS = 1024


class StageClock:
    """Durations of consecutive stages, each also observed in the stage histogram."""

    def __init__(self, metrics: EngineMetrics, clock: Clock) -> None:
        self._metrics = metrics
        self._clock = clock
        self._last = clock()
        self.ms: dict[str, float] = {}

    def mark(self, stage: str) -> None:
        now = self._clock()
        elapsed = now - self._last
        self._last = now
        self.ms[stage] = round(elapsed * 1000, 3)
        self._metrics.stage_seconds.labels(stage).observe(elapsed)


class DecodeEngine:
    role = "decode"

    def __init__(
        self,
        config: EngineConfig,
        *,
        resolver: DecodeResolver,
        transfer: DecodeTransfer,
        faults: Faults,
        metrics: EngineMetrics,
        writer: ReplyWriter,
        rank: DPRank,
        stalls: DecodeStalls,
        advertise_host: str,
        clock: Clock = time.monotonic,
    ) -> None:
        """`rank`: the cache, prefill queue and KV events of a vLLM decode (`--api vllm`),
        which keeps what it pulled and computes prompts sent to it alone; an SGLang decode
        keeps no prefix cache and never prefills, and leaves it unused."""
        self.config = config
        self.resolver = resolver
        self.transfer = transfer
        self._faults = faults
        self._metrics = metrics
        self._writer = writer
        self._clock = clock
        self._decode_ranks = [
            DecodeTopology(tp_size=config.tp, tp_rank=tp, pp_size=config.pp, pp_rank=pp)
            for tp in range(config.tp)
            for pp in range(config.pp)
        ]
        self._urls: OrderedDict[str, None] = OrderedDict()
        self._closing = False
        self._vllm = VllmDecode(config, transfer, writer, metrics, rank, stalls)
        self._rank = rank
        self._advertise_host = advertise_host

    async def start(self) -> None:
        await self.transfer.start()
        self.resolver.start()
        self._rank.scheduler.start()

    async def stop(self) -> None:
        await self._rank.scheduler.stop()
        await self.resolver.stop()
        await self.transfer.stop()

    async def begin_shutdown(self) -> None:
        self._closing = True
        self.transfer.stop_waiting()
        await self.resolver.stop()

    async def generate(self, prompt: Prompt) -> Generation:
        try:
            return await self._generate(prompt)
        except EngineError as exc:
            if self._closing and exc.status >= 500:
                raise EngineError(exc.stage, exc.message, status=503) from None
            raise

    async def _generate(self, prompt: Prompt) -> Generation:
        if self.config.api == "vllm":
            if self._faults.fail_request():
                raise EngineError("fault", "injected failure (--fault-fail-rate)")
            return await self._vllm.generate(prompt)
        if prompt.bootstrap is None:
            raise EngineError(
                "request",
                "a decode instance serves disaggregated requests only: "
                "bootstrap_host and bootstrap_room are required",
                status=400,
            )
        if self._faults.fail_request():
            raise EngineError("fault", "injected failure (--fault-fail-rate)")
        bootstrap = prompt.bootstrap
        stages = StageClock(self._metrics, self._clock)
        url = f"http://{_host(bootstrap.host)}:{bootstrap.port or self.config.bootstrap_port}"
        self._urls[url] = None
        self._urls.move_to_end(url)
        while len(self._urls) > _MAX_KNOWN_URLS:
            self._urls.popitem(last=False)
        producers = await self._resolve(url, prompt, stages)
        targets = {
            RankId(rank.coordinate.dp_rank, rank.coordinate.tp_rank, rank.coordinate.pp_rank): (
                rank.address.rank_ip,
                rank.address.rank_port,
            )
            for producer in producers
            for rank in producer.ranks
        }
        try:
            ready = await self.transfer.exchange(
                bootstrap.room,
                targets,
                connect_timeout=self.config.connect_timeout,
                transfer_timeout=self.config.transfer_timeout,
                on_connected=lambda: stages.mark("connect"),
            )
        except TransferError as exc:
            raise EngineError(exc.stage, str(exc)) from None
        stages.mark("transfer")
        metadata = self._verify_room(bootstrap, ready)
        stages.mark("room")
        output = self._writer.tokens(prompt.max_new_tokens)
        if output:
            output[0] = metadata.first_token
        meta: dict[str, Any] = {
            "prefill_dp_rank": producers[0].dp_rank,
            "queue_ms": metadata.queue_us / 1000,
            "prefill_ms": metadata.prefill_us / 1000,
            "pd_stages_ms": stages.ms,
        }
        return Generation(
            prompt_tokens=len(prompt.input_ids),
            cached_tokens=metadata.cached_tokens,
            tokens=self._consume(output, stages),
            finish_length=len(output),
            meta=meta,
        )

    async def _resolve(
        self, url: str, prompt: Prompt, stages: StageClock
    ) -> list[ResolvedProducer]:
        assert prompt.bootstrap is not None
        try:
            topology = await self.resolver.topology(url)
        except ResolveError as exc:
            raise EngineError("topology" if exc.invalid else "register", str(exc)) from None
        stages.mark("register")
        explicit = prompt.disagg_prefill_dp_rank
        if explicit is not None and explicit >= topology.dp_size:
            raise EngineError(
                "dp_rank",
                f"disagg_prefill_dp_rank {explicit} is outside [0, {topology.dp_size}) "
                f"of the prefill at {url}",
                status=400,
            )
        try:
            producers = await asyncio.gather(
                *(
                    self.resolver.resolve(
                        url,
                        decode_rank,
                        prompt.bootstrap.room,
                        explicit_dp_rank=prompt.disagg_prefill_dp_rank,
                        dp_timeout=self.config.transfer_timeout,
                    )
                    for decode_rank in self._decode_ranks
                )
            )
        except ResolveError as exc:
            raise EngineError(exc.stage, str(exc)) from None
        stages.mark("rank")
        return producers

    def _verify_room(self, bootstrap: Bootstrap, ready: dict[RankId, KVMetadata]) -> KVMetadata:
        for metadata in ready.values():
            if metadata.room == 0:
                self._metrics.room_check_failures.labels("not_ready").inc()
                raise EngineError(
                    "room",
                    f"Metadata not ready (bootstrap_room=0) for request bootstrap_room="
                    f"{bootstrap.room}",
                )
            if metadata.room != bootstrap.room:
                self._metrics.room_check_failures.labels("mismatch").inc()
                raise EngineError(
                    "room",
                    f"Metadata corruption detected - bootstrap_room mismatch: request "
                    f"bootstrap_room={bootstrap.room}, metadata bootstrap_room={metadata.room}",
                )
        return next(iter(ready.values()))

    async def _consume(self, output: list[int], stages: StageClock) -> AsyncIterator[int]:
        async for token in paced(output, self.config.latency.decode_tokens_per_s):
            yield token
        stages.mark("consume")

    async def restart(self) -> None:
        """A restarted decode knows no directory and no prefill rank: forget them all, and
        what its cache held."""
        for url in self._urls:
            self.resolver.invalidate(url)
        self._urls.clear()
        self.transfer.forget_registrations()
        rank = self._rank
        changes = rank.cache.reset()
        if rank.publisher is not None:
            rank.publisher.restart()
        rank.commit(changes)
        await rank.drain()

    async def flush_cache(self) -> None:
        rank = self._rank
        rank.commit(rank.cache.reset())
        await rank.drain()

    def cached_chains(self) -> dict[int, list[list[int]]]:
        return {0: self._rank.cache.cached_chains()}

    def server_info(self) -> dict[str, Any]:
        address = self.transfer.address
        rank = self._rank
        publishers = [] if rank.publisher is None else [rank.publisher]
        return {
            "disaggregation_mode": "decode",
            "kv_events": describe_kv_events(
                publishers, self._advertise_host, self.config.page_size, 1
            ),
            "decode_transfer_endpoint": None
            if address is None
            else f"tcp://{address.ip}:{address.port}",
        }


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
