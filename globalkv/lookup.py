""" "How long a prefix of these tokens does each pod hold?" — one question, two ways to ask.

The gateway and the index API both answer it: locally, by keying the tokens and asking an
`Index` (embedded memory index, or Redis read directly), or remotely through the indexer's
`POST /v1/lookup`. Callers hold a `PrefixLookup` and do not care which.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import httpx

from globalkv.index.base import Index, IndexUnavailable
from globalkv.keys import request_chain


@dataclass(frozen=True, slots=True)
class PodHit:
    pod: str
    dp_rank: int
    hit_blocks: int
    hit_tokens: int
    score: float


@dataclass(frozen=True, slots=True)
class LookupResult:
    block_size: int
    blocks: int
    """Whole index blocks in the prompt (what a perfect hit would cover)."""
    pods: list[PodHit]
    """Best first; sources with no hit are absent."""
    keys: Sequence[int] = field(default=(), compare=False, repr=False)
    """The prompt's block keys (hashed lazily): what the gateway records as sent
    (`gateway.load.pending`) and matches later prompts against."""


class PrefixLookup(Protocol):
    async def lookup(
        self,
        model: str,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> LookupResult:
        """Raises `IndexUnavailable` when the index cannot answer."""
        ...


class IndexLookup:
    """Keys the prompt here and asks an index in this process (or its Redis) directly."""

    def __init__(self, index: Index) -> None:
        self.index = index

    async def lookup(
        self,
        model: str,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> LookupResult:
        block_size = self.index.block_size
        keys = request_chain(token_ids, block_size, model, lora_name, cache_salt)
        hits = await self.index.lookup(keys) if keys else []
        return LookupResult(
            block_size=block_size,
            blocks=len(keys),
            keys=keys,
            pods=[
                PodHit(
                    pod=h.source.pod,
                    dp_rank=h.source.dp_rank,
                    hit_blocks=h.blocks,
                    hit_tokens=h.blocks * block_size,
                    score=h.score,
                )
                for h in hits
            ],
        )


class HttpLookup:
    """Asks a remote indexer's `POST /v1/lookup` with one pooled client."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        indexer_url: str,
        timeout: float = 1.0,
        token: str | None = None,
    ) -> None:
        """`token`: the indexer's admin token, which its lookups need from another host."""
        self.client = client
        self.url = indexer_url.rstrip("/") + "/v1/lookup"
        self.timeout = timeout
        self.headers = {"authorization": f"Bearer {token}"} if token else {}

    async def lookup(
        self,
        model: str,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> LookupResult:
        body: dict[str, object] = {"model": model, "token_ids": list(token_ids)}
        if lora_name is not None:
            body["lora_name"] = lora_name
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        try:
            response = await self.client.post(
                self.url, json=body, timeout=self.timeout, headers=self.headers
            )
        except httpx.HTTPError as exc:
            raise IndexUnavailable(f"indexer at {self.url} unreachable: {exc!r}") from exc
        if response.status_code != 200:
            raise IndexUnavailable(
                f"indexer at {self.url} answered {response.status_code}: {response.text[:200]}"
            )
        try:
            data = response.json()
            block_size = int(data["block_size"])
            return LookupResult(
                block_size=block_size,
                blocks=int(data["blocks"]),
                keys=request_chain(token_ids, block_size, model, lora_name, cache_salt),
                pods=[
                    PodHit(
                        pod=str(p["pod"]),
                        dp_rank=int(p["dp_rank"]),
                        hit_blocks=int(p["hit_blocks"]),
                        hit_tokens=int(p["hit_tokens"]),
                        score=float(p["score"]),
                    )
                    for p in data["pods"]
                ],
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise IndexUnavailable(
                f"indexer at {self.url} sent a malformed answer: {exc!r}"
            ) from exc
