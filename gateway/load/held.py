"""How long a prefix of the prompt each candidate holds, from the index and from what this
gateway sent it: what the prefix policy, the disaggregation decider and flow control's
headroom all start from."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gateway.load.pending import PendingHit
from gateway.load.tracker import Candidate
from globalkv.lookup import LookupResult, PodHit


def held_prefixes(
    lookup: LookupResult, candidates: Sequence[Candidate], pending: Mapping[str, PendingHit]
) -> list[tuple[Candidate, int, int | None]]:
    """Per candidate: the tokens of the longest prefix it holds and the DP rank holding it.

    The longer of what the index shows on the candidate's pod (the best of its DP ranks) and
    what this gateway sent the worker that the index may not show yet (`pending`, by worker:
    `LoadTracker.pending_blocks`); 0 and no rank without either."""
    best: dict[str, PodHit] = {}
    for pod_hit in lookup.pods:
        held = best.get(pod_hit.pod)
        if held is None or pod_hit.hit_tokens > held.hit_tokens:
            best[pod_hit.pod] = pod_hit
    block_size = lookup.block_size
    hits: list[tuple[Candidate, int, int | None]] = []
    for candidate in candidates:
        hit = best.get(candidate.pod)
        hit_tokens, dp_rank = (hit.hit_tokens, hit.dp_rank) if hit else (0, None)
        sent = pending.get(candidate.worker)
        if sent is not None and sent.blocks * block_size > hit_tokens:
            hit_tokens, dp_rank = sent.blocks * block_size, sent.dp_rank
        hits.append((candidate, hit_tokens, dp_rank))
    return hits
