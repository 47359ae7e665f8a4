"""vLLM's PD protocol (its NIXL connector's, as a router sees it) over the emulator's
transfer path.

Prefill: a request whose `kv_transfer_params` say `do_remote_decode` is computed as any
other (prefix cache, queue, KV events), answers its one token and, in the answer's
top-level `kv_transfer_params`, where the decode pulls the KV from: `remote_engine_id`
(this engine), `remote_request_id` (the prefill's own id for the request, protocol v2),
`remote_block_ids` (the prompt's pages), `remote_host`/`remote_port` (the DP rank's
transfer socket), `tp_size`. The blocks are then held for the decode, at most
`--handshake-timeout` seconds, as vLLM's connector holds them until the decode reads them
or its abort timeout frees them. A prefill whose token was EOS answers without params
(`kv_transfer_params: null`, finish_reason "stop"): vLLM's connector keeps nothing then.

Decode: a request with `do_remote_prefill` pulls the KV with the existing handshake
(`enginesim.transfer`): the room both sides use is derived from `remote_request_id`, so
the decode asks the prefill rank at `remote_host:remote_port` for exactly the blocks that
request left. The prefill's request id starts with the request's `X-Request-Id`, as vLLM's
does; a decode whose `X-Request-Id` is another's refuses the pull (400), so a router that
gave the legs different ids is caught. A request without params computes its prompt on
the decode, reusing the prefix the decode's own cache holds (what it pulled or computed
before), which is what a vLLM decode does when the prefill had nothing to send or a
router sent it the request alone.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from enginesim.config import EngineConfig
from enginesim.engine import EngineError, Generation, Prompt
from enginesim.faults import Faults
from enginesim.handshake import MAX_ROOM, KVMetadata, RankId
from enginesim.kvcache import CacheChange, CacheNamespace, PagedKVCache
from enginesim.latency import DecodeStalls, PrefillTiming, paced
from enginesim.metrics import EngineMetrics
from enginesim.textgen import ReplyWriter
from enginesim.transfer import DecodeTransfer, PrefillTransfer, TransferError

log = logging.getLogger(__name__)


def room_of(request_id: str) -> int:
    """The transfer room of a vLLM request, the same on both sides: never 0 (the decode's
    "not written" marker)."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") & MAX_ROOM) or 1


class Rank(Protocol):
    """What the vLLM prefill needs of a DP rank (`enginesim.prefill.DPRank`)."""

    index: int


class VllmPrefill:
    """The prefill side: compute, answer with params, hold the blocks for the decode."""

    def __init__(
        self,
        config: EngineConfig,
        transfer: PrefillTransfer,
        faults: Faults,
        writer: ReplyWriter,
        metrics: EngineMetrics,
    ) -> None:
        self._config = config
        self._transfer = transfer
        self._faults = faults
        self._writer = writer
        self._metrics = metrics
        self.engine_id = uuid.uuid4().hex
        self._held: set[asyncio.Task[None]] = set()

    async def stop(self) -> None:
        for task in self._held:
            task.cancel()
        await asyncio.gather(*self._held, return_exceptions=True)

    async def finish(
        self, prompt: Prompt, rank: Rank, cached: int, meta: dict[str, Any]
    ) -> Generation:
        """The answer of a prompt `rank` has computed (`cached` of its tokens were cached)."""
        first = self._writer.tokens(1)
        rate = self._config.latency.decode_tokens_per_s
        if self._faults.prefill_eos():
            return Generation(
                prompt_tokens=len(prompt.input_ids),
                cached_tokens=cached,
                tokens=paced(first, rate),
                finish_length=1,
                meta=meta,
                stopped=True,
            )
        request_id = f"{prompt.request_id or prompt.rid}-{uuid.uuid4().hex[:12]}"
        room = room_of(request_id)
        rank_id = RankId(rank.index, 0, 0)
        host, port = self._transfer.addresses[rank_id]
        metadata = KVMetadata.computed(
            self._faults.metadata_room(room), cached, len(prompt.input_ids), first[0], meta
        )
        task = asyncio.create_task(self._hold(room, rank_id, metadata))
        self._held.add(task)
        task.add_done_callback(self._held.discard)
        page = self._config.page_size
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request_id,
            "remote_block_ids": list(range(-(-len(prompt.input_ids) // page))),
            "remote_host": host,
            "remote_port": port,
            "tp_size": self._config.tp,
        }
        return Generation(
            prompt_tokens=len(prompt.input_ids),
            cached_tokens=cached,
            tokens=paced(first, rate),
            finish_length=1,
            meta=meta,
            transfer_params=params,
        )

    async def _hold(self, room: int, rank: RankId, metadata: KVMetadata) -> None:
        try:
            dests = await self._transfer.wait_for_decode(
                room, [rank], self._config.handshake_timeout
            )
            await self._transfer.send_ready(room, dests, metadata)
        except TransferError as exc:
            self._metrics.transfer_dropped.labels("vllm_blocks_freed").inc()
            log.info("room %d: blocks freed unread: %s", room, exc)
            await self._transfer.fail(room, f"prefill {exc.stage} stage: {exc}")


class Prefilled(Protocol):
    """What a rank's prefill tells (`enginesim.prefill.Prefilled`)."""

    @property
    def cached_tokens(self) -> int: ...
    @property
    def timing(self) -> PrefillTiming: ...


class DecodeRank(Protocol):
    """What the vLLM decode needs of its one rank (`enginesim.prefill.DPRank`): its prefix
    cache with its KV events, and its prefill queue."""

    cache: PagedKVCache

    def commit(self, changes: Sequence[CacheChange]) -> None: ...

    async def drain(self) -> None: ...

    async def prefill(self, tokens: Sequence[int], namespace: CacheNamespace) -> Prefilled: ...


class VllmDecode:
    """The decode side: pull the prefill's blocks, or compute the prompt here.

    Like vLLM's decode with prefix caching, it keeps what it pulled and what it computed in
    its own cache, which publishes KV events as a prefill's does, so the index knows what
    each decode holds. A prompt it computes goes through the same prefill queue and latency
    model as a prefill engine's, and its running decodes' tokens wait for each of its steps
    (`enginesim.latency.DecodeStalls`)."""

    def __init__(
        self,
        config: EngineConfig,
        transfer: DecodeTransfer,
        writer: ReplyWriter,
        metrics: EngineMetrics,
        rank: DecodeRank,
        stalls: DecodeStalls,
    ) -> None:
        self._config = config
        self._transfer = transfer
        self._writer = writer
        self._metrics = metrics
        self.rank = rank
        self._stalls = stalls

    async def generate(self, prompt: Prompt) -> Generation:
        params = prompt.kv_transfer or {}
        output = self._writer.tokens(prompt.max_new_tokens)
        if not params.get("do_remote_prefill"):
            self._metrics.recomputed.inc()
            prefilled = await self.rank.prefill(prompt.input_ids, prompt.namespace)
            timing = prefilled.timing
            meta = {
                "recomputed": True,
                "queue_ms": timing.queue_s * 1000,
                "prefill_ms": timing.prefill_s * 1000,
            }
            return self._generation(prompt, prefilled.cached_tokens, output, meta)
        request_id, host, port = (
            params.get("remote_request_id"),
            params.get("remote_host"),
            params.get("remote_port"),
        )
        if not (request_id and host and port):
            raise EngineError(
                "request",
                "kv_transfer_params with do_remote_prefill need remote_request_id, "
                "remote_host and remote_port",
                status=400,
            )
        if prompt.request_id is not None and not request_id.startswith(f"{prompt.request_id}-"):
            raise EngineError(
                "request",
                f"remote_request_id {request_id!r} is another request's than this one's "
                f"X-Request-Id {prompt.request_id!r}",
                status=400,
            )
        room = room_of(request_id)
        try:
            ready = await self._transfer.exchange(
                room,
                {RankId(0, 0, 0): (host, port)},
                connect_timeout=self._config.connect_timeout,
                transfer_timeout=self._config.transfer_timeout,
                on_connected=lambda: None,
            )
        except TransferError as exc:
            raise EngineError(exc.stage, str(exc)) from None
        metadata = next(iter(ready.values()))
        if metadata.room != room:
            self._metrics.room_check_failures.labels("mismatch").inc()
            raise EngineError("room", f"KV of another request arrived for {request_id}")
        if output:
            output[0] = metadata.first_token
        self.rank.commit(self.rank.cache.insert(prompt.input_ids, prompt.namespace))
        await self.rank.drain()
        meta = {"queue_ms": metadata.queue_us / 1000, "prefill_ms": metadata.prefill_us / 1000}
        return self._generation(prompt, metadata.cached_tokens, output, meta)

    def _generation(
        self, prompt: Prompt, cached: int, output: list[int], meta: dict[str, Any]
    ) -> Generation:
        return Generation(
            prompt_tokens=len(prompt.input_ids),
            cached_tokens=cached,
            tokens=self._paced(output),
            finish_length=len(output),
            meta=meta,
        )

    def _paced(self, output: list[int]) -> AsyncIterator[int]:
        return paced(output, self._config.latency.decode_tokens_per_s, stalls=self._stalls)
