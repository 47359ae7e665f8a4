"""Whether to disaggregate a request, or let a decode worker prefill it itself.

Moving a prompt's KV from a prefill worker to a decode worker pays when the prefill side
gives the first token sooner than the decode could, transfer included. A short prompt, or
one whose prefix the decode already holds, is often computed sooner where it will be
decoded: no prefill queue, no transfer. But a decode worker that prefills holds up the
requests it is decoding: each of their next tokens waits until the prefill's step is
over. So the decider compares, in seconds (with `local-when-faster`):

    remote    = min over prefills p of (remaining(p) + uncached(p)) / rate(p)
                + prompt tokens / transfer_tokens_per_s
    local(d)  = (remaining(d) + uncached(d)) / rate(d)
    stall(d)  = uncached(d) / rate(d)
    cost(d)   = local(d) + itl_weight * running(d) * stall(d)

and prefills locally on the decode `d` of lowest cost when `cost(d) < remote`. `uncached`
is the prompt less the longest prefix the worker holds (the index, which follows decode
workers' KV events as it follows prefills', and what this gateway sent it that the index
may not show yet); `remaining` the prefill work this gateway sent it that is estimated
still to do, in tokens at its measured rate (`gateway.load.progress`); `rate` that
measured rate, the same the prefix policy's queue estimate drains at; `running` its
requests in flight. A decode that has not yet prefilled anything it was timed on is
assumed as fast as the prefills' mean (one engine, one kind of accelerator); before any
prefill was timed nothing is known, and every request is disaggregated. The remote side is
the greedy estimate, whichever prefill the prefix policy then picks: the decider does not
place blocks, so it never charges cache pressure.

Only decode workers that can prefill what they are sent qualify (`local_capable`): a vLLM
decode computes a request sent without `kv_transfer_params` itself; an SGLang decode-mode
engine refuses a request without bootstrap fields, so SGLang pairs are always
disaggregated (SGLang's local prefill needs aggregated workers, which the pool does not
hold). Batches are always disaggregated too.

The decider is pure (no clock, no I/O, no state): the gateway calls it per attempt with
its candidates (`gateway.routing.pd_chooser`), the simulator with its own, and a
decode-side sidecar can call it with what it knows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from gateway.load.held import held_prefixes
from gateway.load.tracker import Candidate
from gateway.policies.base import Choice
from gateway.requests.query import RouteQuery
from gateway.settings.base import Kind
from gateway.settings.routing import PdDeciderConfig

Reason = Literal[
    "always", "faster", "slower", "no_lookup", "no_local_decode", "unmeasured", "batch"
]
"""Why: `faster` (local) or `slower` (disaggregated) by the estimate; `always` (the decider
is off); `no_lookup` (no tokens or no index answer: nothing to estimate from);
`no_local_decode` (no eligible decode can prefill: none of a capable kind); `unmeasured` (no
prefill rate measured yet); `batch` (a batch request)."""


def local_capable(kind: Kind) -> bool:
    """Whether a decode worker of `kind` prefills a request sent to it alone."""
    return kind == "vllm"


# Built per request: its own __init__, compiled where the module is (the dataclass gives
# eq and repr only; its generated __init__ runs interpreted): docs/gateway-design.md.
@dataclass(slots=True, init=False)
class PdDecision:
    local: bool
    reason: Reason
    decode: Candidate | None
    """The decode that prefills locally (None when disaggregated)."""
    choice: Choice | None
    """What the local decode is expected to hold and compute (its load and pending keys)."""
    local_s: float | None
    """The chosen decode's `cost` (or the best one's, when disaggregated), seconds."""
    remote_s: float | None
    """The disaggregated path's estimate, seconds."""

    def __init__(
        self,
        local: bool,
        reason: Reason,
        decode: Candidate | None = None,
        choice: Choice | None = None,
        local_s: float | None = None,
        remote_s: float | None = None,
    ) -> None:
        self.local = local
        self.reason = reason
        self.decode = decode
        self.choice = choice
        self.local_s = local_s
        self.remote_s = remote_s


class PdDecider:
    def __init__(self, config: PdDeciderConfig) -> None:
        self.config = config

    @property
    def enabled(self) -> bool:
        return self.config.mode != "always"

    def decide(
        self,
        request: RouteQuery,
        prefills: Sequence[Candidate],
        decodes: Sequence[Candidate],
        rate: Callable[[str], float | None],
    ) -> PdDecision:
        """`decodes`: the eligible decode workers that can prefill (`local_capable`);
        `rate(worker)`: its measured prefill tokens/s, None before one was timed."""
        if not self.enabled:
            return PdDecision(False, "always")
        lookup = request.lookup
        if lookup is None or request.tokens is None:
            return PdDecision(False, "no_lookup")
        if not decodes:
            return PdDecision(False, "no_local_decode")
        measured = [r for r in (rate(c.worker) for c in prefills) if r]
        if not measured:
            return PdDecision(False, "unmeasured")
        default_rate = sum(measured) / len(measured)
        prompt = request.prompt_tokens
        remote = (
            min(
                (c.remaining_prefill_tokens + max(prompt - hit, 0))
                / (rate(c.worker) or default_rate)
                for c, hit, _ in held_prefixes(lookup, prefills, request.pending)
            )
            + prompt / self.config.transfer_tokens_per_s
        )
        best: tuple[float, Candidate, int, int | None] | None = None
        for c, hit, dp_rank in held_prefixes(lookup, decodes, request.pending):
            speed = rate(c.worker) or default_rate
            uncached = max(prompt - hit, 0)
            stall = uncached / speed
            cost = (
                c.remaining_prefill_tokens + uncached
            ) / speed + self.config.itl_weight * c.in_flight * stall
            if best is None or cost < best[0]:
                best = (cost, c, hit, dp_rank)
        assert best is not None
        cost, decode, hit, dp_rank = best
        if cost >= remote:
            return PdDecision(False, "slower", local_s=cost, remote_s=remote)
        held = min(hit, prompt)
        choice = Choice(decode.worker, dp_rank, held, prompt - held)
        return PdDecision(True, "faster", decode, choice, cost, remote)
