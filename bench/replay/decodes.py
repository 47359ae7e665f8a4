"""Simulated decode pods: what they hold, the prompts they prefill themselves, and the
token times of the requests they decode.

A decode pod keeps what it pulled from a prefill and what it computed in its own
`PagedKVCache`, whose inserts reach the index as a prefill pod's do (vLLM's decode with
prefix caching publishes them). A prompt it prefills itself goes through a `PrefillPod`'s
steps at the prefill pods' rate. Each of its running requests emits a token every
`interval` seconds, except that a token due while one of those prefill steps runs comes at
the step's end, and the next ones follow at the interval from there: the rule of the
emulated engine (`enginesim.latency.DecodeStalls`). Each such stretched interval is kept,
so the replay reports inter-token latency over all tokens.

`isl_bounding` is NVIDIA Dynamo's conditional-disaggregation rule, reimplemented as the
baseline: a request skips the remote prefill when the part of its prompt the cache-hot
decode does not hold is under 2,048 tokens and under 0.7 of the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.replay.pods import PrefillPod

ISL_BOUND_TOKENS = 2048
ISL_BOUND_RATIO = 0.7


def isl_bounding(prompt: int, decode_hit: int) -> bool:
    """Dynamo's `IslBoundingPolicy` with its defaults: prefill on the decode."""
    effective = max(prompt - decode_hit, 0)
    return effective < ISL_BOUND_TOKENS and effective / max(prompt, 1) < ISL_BOUND_RATIO


@dataclass(slots=True)
class Decoding:
    """One request's tokens on a decode pod from `anchor`, when its latest token came."""

    anchor: float
    left: int
    """Tokens still to emit after the one at `anchor`."""
    stretched: list[float] = field(default_factory=list)
    """Intervals between two tokens that a prefill step held up, seconds."""

    def end(self, interval: float) -> float:
        return self.anchor + self.left * interval


@dataclass(slots=True)
class DecodePod:
    name: str
    prefill: PrefillPod
    """Its cache, its KV events and its own prefill steps."""
    interval: float
    running: dict[int, Decoding] = field(default_factory=dict)

    def start(self, request: int, now: float, tokens: int) -> float:
        """Request `request`'s first token is out at `now`; when its last one will be."""
        decoding = Decoding(now, max(tokens - 1, 0))
        self.running[request] = decoding
        return decoding.end(self.interval)

    def stall(self, start: float, end: float) -> dict[int, float]:
        """A prefill step runs on this pod over [start, end): the running requests whose
        next token was due in it, with their new ends."""
        moved: dict[int, float] = {}
        interval = self.interval
        for request, d in self.running.items():
            emitted = min(int((start - d.anchor) / interval), d.left)
            if emitted >= d.left:
                continue
            due = d.anchor + (emitted + 1) * interval
            if due >= end:
                continue
            d.stretched.append(end - (d.anchor + emitted * interval))
            d.left -= emitted + 1
            d.anchor = end
            moved[request] = d.end(interval)
        return moved

    def finish(self, request: int) -> Decoding:
        return self.running.pop(request)
