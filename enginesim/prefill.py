"""The prefill role: prefix cache, prefill queue and KV events per DP rank, and the PD handshake.

With bootstrap fields a prompt is served as SGLang's disaggregated prefill serves it:
choose the DP rank (`routed_dp_rank`, else `room % dp` when following the room, else round
robin with the room registered in the directory so the decode can query it), wait for the
decode's handshake on every rank of that DP group, compute the uncached part, then send
the decode the KV-ready message with the room in its metadata. The HTTP answer carries
the first token only, with `finish_reason.length` 0, as SGLang's prefill answers.

With vLLM's `kv_transfer_params` asking for a remote decode (`--api vllm`) it computes the
prompt and holds its blocks for the decode (`enginesim.vllm`).

Without bootstrap fields it serves the prompt whole (prefill then local decode), which is
how a colocated engine behaves and what non-PD routing exercises.

Events for a prompt's pages are handed to the PUB socket before the prompt's first token
is returned, so a client that got an answer knows the events are on their way.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from bootstrap.protocol import RankRegistration
from bootstrap.registrar import (
    DirectoryRegistrationFailed,
    KeepAlive,
    register_rank,
    register_room_dp_rank,
)
from enginesim.config import EngineConfig
from enginesim.engine import Bootstrap, EngineError, Generation, Prompt
from enginesim.faults import Faults
from enginesim.handshake import DecodeAddress, KVMetadata, RankId
from enginesim.kvcache import BASE, CacheChange, CacheNamespace, Match, PagedKVCache, Removed
from enginesim.latency import PrefillScheduler, PrefillTiming, paced
from enginesim.metrics import EngineMetrics
from enginesim.publisher import KVEventPublisher, describe_kv_events, wire_events
from enginesim.textgen import ReplyWriter
from enginesim.transfer import PrefillTransfer, TransferError
from enginesim.vllm import VllmPrefill
from kvplumbing.clock import Clock


@dataclass(eq=False, slots=True)
class DPRank:
    """One DP rank's state: its cache, its prefill queue, its event stream.

    The publisher arrives started and is stopped by whoever built it (its ports must be
    known before the engine advertises them).
    """

    index: int
    cache: PagedKVCache
    scheduler: PrefillScheduler
    publisher: KVEventPublisher | None
    metrics: EngineMetrics

    def commit(self, changes: Sequence[CacheChange]) -> None:
        label = str(self.index)
        for change in changes:
            if isinstance(change, Removed):
                self.metrics.cache_evictions.labels(label).inc(len(change.hashes))
        if self.publisher is not None:
            flavor = self.publisher.settings.flavor
            self.publisher.publish(wire_events(changes, self.cache.page_size, flavor))

    async def drain(self) -> None:
        if self.publisher is not None:
            await self.publisher.drain()

    async def prefill(self, tokens: Sequence[int], namespace: CacheNamespace = BASE) -> Prefilled:
        """Queue the prompt and compute what the cache lacks when its first chunk starts.

        While it waits it counts as what the cache lacked on arrival; its events are on
        their way to the PUB socket when this returns.
        """
        work = _CachedPrefill(self, tokens, namespace)
        try:
            estimate = len(tokens) - self.cache.peek(tokens, namespace)
            timing = await self.scheduler.run(work, estimate=estimate)
        finally:
            if work.match is not None:
                self.cache.release(work.match)  # a no-op unless it failed or was cancelled
        await self.drain()
        assert work.match is not None
        return Prefilled(work.match.cached_tokens, timing)

    def queued_tokens(self) -> float:
        return self.scheduler.queued_tokens

    def cached_pages(self) -> float:
        return len(self.cache)


@dataclass(frozen=True, slots=True)
class Prefilled:
    cached_tokens: int
    """The prefix found in the cache when the prompt's first chunk was planned."""
    timing: PrefillTiming


@dataclass(eq=False, slots=True)
class _CachedPrefill:
    """A prompt as its rank's scheduler drives it (`enginesim.latency.PrefillWork`): its
    prefix is matched and locked when its first chunk is planned, its pages stored and the
    lock released when its last chunk ends, before the next step is planned."""

    rank: DPRank
    tokens: Sequence[int]
    namespace: CacheNamespace
    match: Match | None = None

    def start(self) -> int:
        self.match = self.rank.cache.match(self.tokens, self.namespace)
        return len(self.tokens) - self.match.cached_tokens

    def finish(self) -> None:
        assert self.match is not None
        self.rank.commit(self.rank.cache.insert(self.tokens, self.namespace))
        self.rank.cache.release(self.match)


class PrefillEngine:
    role = "prefill"

    def __init__(
        self,
        config: EngineConfig,
        *,
        ranks: Sequence[DPRank],
        transfer: PrefillTransfer,
        client: httpx.AsyncClient,
        bootstrap_url: str,
        http_port: int,
        advertise_host: str,
        faults: Faults,
        metrics: EngineMetrics,
        writer: ReplyWriter,
        clock: Clock = time.monotonic,
    ) -> None:
        self.config = config
        self.ranks = list(ranks)
        self.transfer = transfer
        self._client = client
        self._bootstrap_url = bootstrap_url
        self._http_port = http_port
        self._advertise_host = advertise_host
        self._faults = faults
        self._metrics = metrics
        self._writer = writer
        self._clock = clock
        self._round_robin = itertools.count()
        self._keepalive: KeepAlive | None = None
        self._closing = False
        self._vllm = VllmPrefill(config, transfer, faults, writer, metrics)
        for rank in self.ranks:
            label = str(rank.index)
            metrics.queued_prefill_tokens.labels(label).set_function(rank.queued_tokens)
            metrics.cache_pages.labels(label).set_function(rank.cached_pages)

    def rank_ids(self, dp_rank: int) -> list[RankId]:
        return [
            RankId(dp_rank, tp, pp) for tp in range(self.config.tp) for pp in range(self.config.pp)
        ]

    async def start(self) -> None:
        for rank in self.ranks:
            rank.scheduler.start()
        await self.transfer.start()
        registrations = [self._registration(r) for d in self.ranks for r in self.rank_ids(d.index)]
        await asyncio.gather(
            *(register_rank(self._client, self._bootstrap_url, reg) for reg in registrations)
        )
        self._keepalive = KeepAlive(
            self._client,
            self._bootstrap_url,
            registrations,
            interval=self.config.keepalive_interval,
        )
        self._keepalive.start()

    async def stop(self) -> None:
        if self._keepalive is not None:
            await self._keepalive.stop()
        await self._vllm.stop()
        await self.transfer.stop()
        for rank in self.ranks:
            await rank.scheduler.stop()

    async def begin_shutdown(self) -> None:
        self._closing = True
        self.transfer.stop_waiting()

    def _registration(self, rank: RankId) -> RankRegistration:
        ip, port = self.transfer.addresses[rank]
        return RankRegistration(
            attn_tp_size=self.config.tp,
            attn_tp_rank=rank.tp,
            attn_cp_size=1,
            attn_cp_rank=0,
            attn_dp_size=self.config.dp,
            attn_dp_rank=rank.dp,
            pp_size=self.config.pp,
            pp_rank=rank.pp,
            system_dp_size=1,
            system_dp_rank=0,
            rank_ip=ip,
            rank_port=port,
            page_size=self.config.page_size,
            kv_cache_dtype="auto",
            load_balance_method=self.config.load_balance_method,
            prefill_http_port=self._http_port,
        )

    async def generate(self, prompt: Prompt) -> Generation:
        room = prompt.bootstrap.room if prompt.bootstrap is not None else None
        try:
            if self._faults.fail_request():
                raise EngineError("fault", "injected failure (--fault-fail-rate)")
            rank = self._choose_rank(prompt)
            if prompt.bootstrap is None:
                transfer = prompt.kv_transfer
                if self.config.api == "vllm" and transfer and transfer.get("do_remote_decode"):
                    cached, meta = await self._prefill(prompt, rank)
                    return await self._vllm.finish(prompt, rank, cached, meta)
                return await self._colocated(prompt, rank)
            return await self._disaggregated(prompt, prompt.bootstrap, rank)
        except EngineError as exc:
            if room is not None:
                await self.transfer.fail(room, f"prefill {exc.stage} stage: {exc.message}")
            if self._closing and exc.status >= 500:
                raise EngineError(exc.stage, exc.message, status=503) from None
            raise
        except asyncio.CancelledError:
            if room is not None:
                await self.transfer.fail(room, "prefill request cancelled")
            raise

    def _choose_rank(self, prompt: Prompt) -> DPRank:
        dp = self.config.dp
        if prompt.routed_dp_rank is not None:
            if not 0 <= prompt.routed_dp_rank < dp:
                raise EngineError(
                    "request",
                    f"routed_dp_rank {prompt.routed_dp_rank} outside [0, {dp})",
                    status=400,
                )
            return self.ranks[prompt.routed_dp_rank]
        if (
            prompt.bootstrap is not None
            and self.config.load_balance_method == "follow_bootstrap_room"
        ):
            return self.ranks[prompt.bootstrap.room % dp]
        return self.ranks[next(self._round_robin) % dp]

    async def _prefill(self, prompt: Prompt, rank: DPRank) -> tuple[int, dict[str, Any]]:
        """Compute the uncached part of the prompt; returns (cached tokens, timing meta)."""
        done = await rank.prefill(prompt.input_ids, prompt.namespace)
        timing = done.timing
        self._metrics.prompt_tokens.labels("cached").inc(done.cached_tokens)
        self._metrics.prompt_tokens.labels("computed").inc(
            len(prompt.input_ids) - done.cached_tokens
        )
        self._metrics.queue_seconds.observe(timing.queue_s)
        self._metrics.prefill_seconds.observe(timing.prefill_s)
        return done.cached_tokens, {
            "queue_ms": round(timing.queue_s * 1000, 3),
            "prefill_ms": round(timing.prefill_s * 1000, 3),
            "dp_rank": rank.index,
        }

    async def _colocated(self, prompt: Prompt, rank: DPRank) -> Generation:
        cached, meta = await self._prefill(prompt, rank)
        output = self._writer.tokens(prompt.max_new_tokens)
        return Generation(
            prompt_tokens=len(prompt.input_ids),
            cached_tokens=cached,
            tokens=self._decode_locally(prompt, rank, output),
            finish_length=len(output),
            meta=meta,
        )

    async def _decode_locally(
        self, prompt: Prompt, rank: DPRank, output: list[int]
    ) -> AsyncIterator[int]:
        async for token in paced(output, self.config.latency.decode_tokens_per_s):
            yield token
        rank.commit(rank.cache.insert([*prompt.input_ids, *output], prompt.namespace))
        await rank.drain()

    async def _disaggregated(
        self, prompt: Prompt, bootstrap: Bootstrap, rank: DPRank
    ) -> Generation:
        room = bootstrap.room
        if self.config.load_balance_method != "follow_bootstrap_room" and self.config.dp > 1:
            try:
                await register_room_dp_rank(self._client, self._bootstrap_url, room, rank.index)
            except DirectoryRegistrationFailed as exc:
                raise EngineError("register_room", str(exc)) from None
        started = self._clock()
        try:
            dests: dict[RankId, DecodeAddress] = await self.transfer.wait_for_decode(
                room, self.rank_ids(rank.index), self.config.handshake_timeout
            )
        except TransferError as exc:
            raise EngineError(exc.stage, str(exc)) from None
        bootstrap_ms = round((self._clock() - started) * 1000, 3)
        cached, meta = await self._prefill(prompt, rank)
        first = self._writer.tokens(1)
        metadata = KVMetadata.computed(
            self._faults.metadata_room(room), cached, len(prompt.input_ids), first[0], meta
        )
        try:
            await self.transfer.send_ready(room, dests, metadata)
        except TransferError as exc:
            raise EngineError(exc.stage, str(exc)) from None
        return Generation(
            prompt_tokens=len(prompt.input_ids),
            cached_tokens=cached,
            tokens=paced(first, self.config.latency.decode_tokens_per_s),
            finish_length=0,
            meta={**meta, "bootstrap_ms": bootstrap_ms},
        )

    async def restart(self) -> None:
        for rank in self.ranks:
            changes = rank.cache.reset()
            if rank.publisher is not None:
                rank.publisher.restart()
            rank.commit(changes)
            await rank.drain()

    def cached_chains(self) -> dict[int, list[list[int]]]:
        return {rank.index: rank.cache.cached_chains() for rank in self.ranks}

    async def flush_cache(self) -> None:
        for rank in self.ranks:
            rank.commit(rank.cache.reset())
            await rank.drain()

    def server_info(self) -> dict[str, Any]:
        publishers = [rank.publisher for rank in self.ranks if rank.publisher is not None]
        return {
            "disaggregation_mode": "prefill",
            "kv_events": describe_kv_events(
                publishers, self._advertise_host, self.config.page_size, self.config.dp
            ),
            "kv_cache": [
                {
                    "dp_rank": rank.index,
                    "pages": len(rank.cache),
                    "capacity": rank.cache.capacity,
                    "queued_prefill_tokens": rank.scheduler.queued_tokens,
                    "next_event_seq": None if rank.publisher is None else rank.publisher.next_seq,
                }
                for rank in self.ranks
            ],
        }
