"""How much of a prefill's queue is still ahead of a new prompt, estimated from outside.

The gateway knows what it sent each prefill (the uncached tokens of every prompt whose
prefill has not answered) but not how far the worker has got through it. Counting all of
it as still to do over-states the wait on a busy worker by up to the whole prompt it is
computing, and the prefix policy then moves prompts off the pod that holds their prefix
for a wait that is mostly over (the replayed hit rates: `docs/gateway-design.md`).

The estimate is a fluid queue per worker, in *work*: sending a prompt adds its work to a
backlog that drains at the worker's measured rate, and every answer caps the backlog at
the work still open. A prompt's work is not just its uncached tokens: attention makes a
token at context position p cost more the larger p is, so 5,000 tokens after a 60,000
token cached prefix take far longer than the first 5,000 of a prompt. Each worker's time
per prompt is therefore fitted as

    seconds = a * tokens + b * tokens * position     (position: the uncached part's middle)

by decayed least squares over its answers, each answer timed by the busy time since the
previous one. The backlog is kept in the seconds the fit predicts, and shown to the policy
in tokens at the worker's average rate (tokens answered over seconds busy), so on an
engine whose cost is linear it is plain tokens. Dividing by the fitted `a` instead blew
the estimate up wherever a fixed cost per request (HTTP, the KV handshake) made short
prompts after long contexts look slow: `b` took the overhead, `a` went towards zero, and
the policy fled every busy holder; draining every token at the average rate instead of
the fit made followers wait behind long-context holders that were far from done.
Nothing is assumed about the engine. Where several gateways share a prefill, each sees
the pod busy with the others' prompts too and measures it slower than it is, so its
estimate errs toward the plain sum.

Two bounds keep a wrong fit from doing harm. The backlog never falls below the open work
behind the oldest open prompt (prefill is first come first served, so only that one can
be partly done), and never exceeds the open work. Before the first answer there is no
fit and the estimate is the open tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Weight kept by the fit's history at each answer: ~50 answers' memory.
_DECAY = 0.98
# The two-term fit is used only when its normal equations are this far from singular
# (prompts of one context length cannot tell the terms apart); else the linear one.
_CONDITION = 1e-6


@dataclass(slots=True)
class CostFit:
    """Decayed weighted least squares of `seconds = a * tokens + b * tokens * position`."""

    uu: float = 0.0
    uq: float = 0.0
    qq: float = 0.0
    us: float = 0.0
    qs: float = 0.0

    def add(self, tokens: int, spread: float, seconds: float) -> None:
        """`spread`: tokens × their mean context position.

        Each answer weighs 1 / tokens. The time between two answers is only roughly the
        later prompt's (prompts share steps, and a long one is computed while shorter
        ones answer); weighted so, the linear fit is total time over total tokens, which
        those errors cannot bias, where plain least squares let the longest prompts'
        misattributed times set the rate (fitted rates off by up to 3×)."""
        u, q = float(tokens), spread
        position = q / u
        self.uu = self.uu * _DECAY + u
        self.uq = self.uq * _DECAY + q
        self.qq = self.qq * _DECAY + q * position
        self.us = self.us * _DECAY + seconds
        self.qs = self.qs * _DECAY + position * seconds

    def tokens_per_s(self) -> float | None:
        """Tokens answered over seconds busy: the average rate, whatever the terms' split."""
        return self.uu / self.us if self.us > 0 else None

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b) with a > 0 and b >= 0; None before a positive time was measured."""
        det = self.uu * self.qq - self.uq * self.uq
        if det > _CONDITION * self.uu * self.qq:
            a = (self.qq * self.us - self.uq * self.qs) / det
            b = (self.uu * self.qs - self.uq * self.us) / det
            if a > 0 and b >= 0:
                return a, b
        if self.uu > 0 and self.us > 0:
            return self.us / self.uu, 0.0
        return None


@dataclass(slots=True)
class PrefillProgress:
    """One worker's open prefills in send order and its estimated backlog of work."""

    open: dict[int, tuple[int, float]] = field(default_factory=dict)
    """Ticket serial -> (uncached tokens, tokens × mean context position), oldest first."""
    open_tokens: int = 0
    open_spread: float = 0.0
    backlog: float = 0.0
    """Seconds of work, each prompt's at the fit of the time it was sent."""
    at: float = 0.0
    """When `backlog` and the busy time were last brought up to date."""
    fit: CostFit = field(default_factory=CostFit)
    fitted: tuple[float, float] | None = None
    """The fit's (a, b) as of the last answer."""
    busy_unanswered_s: float = 0.0
    """Busy time since the last answer: what the next computed answer is timed by."""

    @property
    def tokens_per_s(self) -> float | None:
        """The measured average rate; None before an answer was timed."""
        return self.fit.tokens_per_s()

    def sent(self, serial: int, tokens: int, now: float, context: int = 0) -> None:
        """`context`: the cached prefix the uncached `tokens` follow."""
        self._advance(now)
        spread = tokens * (context + tokens / 2)
        self.open[serial] = (tokens, spread)
        self.open_tokens += tokens
        self.open_spread += spread
        if self.fitted is not None:
            a, b = self.fitted
            self.backlog += a * tokens + b * spread

    def answered(self, serial: int, now: float, computed: bool) -> None:
        """`computed`: the prefill did its work, so its tokens and time measure the fit."""
        self._advance(now)
        sent = self.open.pop(serial, None)
        if sent is None:
            return
        tokens, spread = sent
        self.open_tokens -= tokens
        self.open_spread = self.open_spread - spread if self.open else 0.0
        if computed and self.busy_unanswered_s > 0:
            self.fit.add(tokens, spread, self.busy_unanswered_s)
        self.busy_unanswered_s = 0.0
        first = self.fitted is None
        self.fitted = self.fit.coefficients()
        if self.fitted is not None:
            still_open = self._seconds(self.open_tokens, self.open_spread)
            self.backlog = still_open if first else min(self.backlog, still_open)

    def remaining(self, now: float) -> int:
        """The work still to do of what was sent, as estimated at `now`, in tokens at the
        worker's average rate (so a long-context prompt counts for more than its tokens)."""
        if not self.open:
            return 0
        rate = self.fit.tokens_per_s()
        if self.fitted is None or rate is None:
            return self.open_tokens
        backlog = self.backlog - max(now - self.at, 0.0)
        oldest, oldest_spread = next(iter(self.open.values()))
        behind_oldest = self._seconds(self.open_tokens - oldest, self.open_spread - oldest_spread)
        return round(max(backlog, behind_oldest) * rate)

    def _seconds(self, tokens: float, spread: float) -> float:
        assert self.fitted is not None
        a, b = self.fitted
        return a * tokens + b * spread

    def _advance(self, now: float) -> None:
        elapsed = now - self.at
        if elapsed > 0:
            if self.open:
                self.busy_unanswered_s += elapsed
                self.backlog = max(self.backlog - elapsed, 0.0)
            self.at = now
