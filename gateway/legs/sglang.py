"""Binding a request to its prefill: the bootstrap fields, as one pure function.

Both the prefill and the decode receive the same body with `bootstrap_host`,
`bootstrap_port` and `bootstrap_room` (`docs/protocols.md` §2). A batch gets lists of equal
length, one fresh room per element: `/generate` with a list `text` or a list of
`input_ids` lists, `/v1/completions` with a list of strings or of token lists, a chat
with `n > 1`. Every other field is kept as the client sent it; bootstrap fields the client
sent are replaced, because only the gateway knows which prefill it chose.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from random import Random
from typing import Any, Literal

Endpoint = Literal["generate", "completions", "chat"]

MAX_ROOM = 2**63 - 1


def _is_token_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) for t in value)


def batch_size(endpoint: Endpoint, body: Mapping[str, Any]) -> int | None:
    """Elements of a batch request, or None for a single request."""
    if endpoint == "generate":
        text, ids = body.get("text"), body.get("input_ids")
        if isinstance(text, list):
            return len(text)
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            return len(ids)
        return None
    if endpoint == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not _is_token_list(prompt):
            return len(prompt)
        return None
    n = body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else None


def draw_room(rng: Random, dp_size: int | None = None, dp_rank: int | None = None) -> int:
    """A room in [1, 2^63-1]; with a DP rank, one whose `room % dp_size == dp_rank`.

    Room 0 is never drawn: a decode reads 0 as "KV metadata not written yet".
    """
    if dp_size is None or dp_size <= 1 or dp_rank is None:
        return rng.randint(1, MAX_ROOM)
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is outside dp_size {dp_size}")
    lowest = 1 if dp_rank == 0 else 0
    return rng.randint(lowest, (MAX_ROOM - dp_rank) // dp_size) * dp_size + dp_rank


def inject_bootstrap(
    body: Mapping[str, Any],
    endpoint: Endpoint,
    *,
    host: str,
    port: int | None,
    rooms: Sequence[int],
) -> dict[str, Any]:
    """A copy of `body` bound to one prefill: `rooms` holds one room per batch element."""
    size = batch_size(endpoint, body)
    expected = 1 if size is None else size
    if len(rooms) != expected:
        raise ValueError(f"{len(rooms)} rooms for a request of {expected} element(s)")
    if any(not 0 < room <= MAX_ROOM for room in rooms):
        raise ValueError("rooms must be in [1, 2^63-1]")
    out = dict(body)
    if size is None:
        out["bootstrap_host"] = host
        out["bootstrap_port"] = port
        out["bootstrap_room"] = rooms[0]
    else:
        out["bootstrap_host"] = [host] * size
        out["bootstrap_port"] = [port] * size
        out["bootstrap_room"] = list(rooms)
    return out
