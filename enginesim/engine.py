"""What the HTTP layer asks of an engine, whichever its role: one prompt in, tokens out.

The app turns every endpoint (`/generate`, completions, chat; single, batch, n > 1) into
`Prompt`s and each engine answers with a `Generation` whose tokens are paced by the
latency model. Keeping this one narrow interface means the SGLang and OpenAI surfaces
exist once, for both roles, and a role differs only in how it gets the first token.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from enginesim.kvcache import BASE, CacheNamespace

Api = Literal["sglang", "vllm"]
"""The PD protocol served: SGLang's bootstrap rooms, or vLLM's `kv_transfer_params`."""


@dataclass(frozen=True, slots=True)
class Bootstrap:
    """The PD fields a router injects (PROTOCOLS §2) for one prompt."""

    host: str
    port: int | None
    room: int


@dataclass(frozen=True, slots=True)
class Prompt:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    bootstrap: Bootstrap | None = None
    routed_dp_rank: int | None = None
    disagg_prefill_dp_rank: int | None = None
    kv_transfer: dict[str, Any] | None = None
    """vLLM's `kv_transfer_params` as the request gave them (validated field by field)."""
    request_id: str | None = None
    """vLLM: the request's `X-Request-Id`, which both legs of one request carry."""
    namespace: CacheNamespace = BASE
    """The LoRA adapter and cache salt its KV is cached under."""


@dataclass(slots=True)
class Generation:
    """A prompt past its prefill (local, or the remote prefill's KV verified).

    `meta` becomes part of SGLang's `meta_info`; an engine may complete it while tokens
    flow (the decode times its `consume` stage when the last token is out).
    """

    prompt_tokens: int
    cached_tokens: int
    tokens: AsyncIterator[int]
    finish_length: int
    """SGLang's `finish_reason.length`: 0 for a PD prefill, else the tokens generated."""
    meta: dict[str, Any] = field(default_factory=dict)
    transfer_params: dict[str, Any] | None = None
    """vLLM: the `kv_transfer_params` a prefill answers with (None: nothing to pull)."""
    stopped: bool = False
    """Ended on EOS (OpenAI's finish_reason "stop") rather than at its length."""


class EngineError(Exception):
    """A prompt that cannot be served; `stage` names where it failed, `status` the HTTP code."""

    def __init__(self, stage: str, message: str, *, status: int = 500) -> None:
        super().__init__(message)
        self.stage = stage
        self.status = status
        self.message = message


class Engine(Protocol):
    role: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def begin_shutdown(self) -> None:
        """Fail every prompt waiting on a peer now, with 503, and each new one: the server
        is about to stop, and a wait for a decode or a prefill could outlast its grace."""
        ...

    async def generate(self, prompt: Prompt) -> Generation:
        """Run the prompt up to its first token; raises `EngineError`."""
        ...

    def server_info(self) -> dict[str, Any]:
        """Role-specific fields of `/server_info`."""
        ...

    async def restart(self) -> None:
        """Forget all KV and restart event seqs, as a restarted engine process would."""
        ...

    async def flush_cache(self) -> None: ...

    def cached_chains(self) -> dict[int, list[list[int]]]:
        """By DP rank, the tokens of each cached prefix no longer one extends (none for a
        decode): what an index following this engine should hold, no more, no less."""
        ...
