"""Each tenant's recent usage, the measure fair dequeuing compares.

A tenant is charged the tokens of every request it is served (its prompt), and its usage
halves every `half_life` seconds, so it measures the last minute or so, not all time.
To compare tenants without decaying every one of them at every read, a charge at time
`t` is stored multiplied by `2^((t - origin) / half_life)`: every stored value then
decays alike, so their order is their decayed order, and the decayed value is the
stored one divided by the scale at the time it is read. The origin moves forward now
and then so the scale stays a modest float.

What other gateway replicas served (`gateway.replicas.shared_flow`) is kept beside this
gateway's own, replaced at every round of sharing, so a tenant served heavily by one
replica waits behind the others at every replica.

A tenant coming back after a pause would otherwise find its usage decayed to nothing and
take the whole band until it caught up: like the virtual token counter of VTC (Sheng et
al., "Fairness in Serving Large Language Models"), its usage is lifted, as it joins the
backlog, to the least usage among the tenants already waiting in its band.

The tenants kept are bounded (`max_tenants`): past it the one charged longest ago that has
nothing queued is forgotten (its usage was the smallest to matter, and a forgotten tenant
is lifted like any other when it comes back).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Mapping

_REBASE = 512.0
"""The scale's exponent past which the origin moves (2^512 stays far from overflow)."""


class TooManyTenants(Exception):
    """Every tenant kept has requests queued: a new one cannot be kept."""


class Usage:
    def __init__(self, half_life_s: float, max_tenants: int, origin: float = 0.0) -> None:
        self._half_life = half_life_s
        self._max = max_tenants
        self._origin = origin
        self._own: OrderedDict[str, float] = OrderedDict()
        """Scaled usage this replica charged, least recently charged first."""
        self._others: dict[str, float] = {}
        """Scaled usage the other replicas reported."""

    def __len__(self) -> int:
        return len(self._own)

    def scale(self, now: float) -> float:
        exponent = (now - self._origin) / self._half_life
        if exponent > _REBASE:
            self._rebase(now)
            exponent = 0.0
        return math.pow(2.0, exponent)

    def _rebase(self, now: float) -> None:
        factor = math.pow(2.0, -(now - self._origin) / self._half_life)
        for table in (self._own, self._others):
            for tenant in table:
                table[tenant] *= factor
        self._origin = now

    def total(self, tenant: str) -> float:
        """Scaled: comparable between tenants, not a number of tokens."""
        return self._own.get(tenant, 0.0) + self._others.get(tenant, 0.0)

    def decayed(self, tenant: str, now: float) -> float:
        """Tokens, decayed to `now`, counted by every replica."""
        return self.total(tenant) / self.scale(now)

    def keep(self, tenant: str, busy: Callable[[str], bool]) -> None:
        """Make room for `tenant`, forgetting the tenant charged longest ago that `busy`
        says has nothing queued; `TooManyTenants` when none can go."""
        if tenant in self._own:
            return
        if len(self._own) >= self._max:
            idle = next((t for t in self._own if not busy(t)), None)
            if idle is None:
                raise TooManyTenants
            del self._own[idle]
        self._own[tenant] = 0.0

    def charge(self, tenant: str, tokens: float, now: float) -> None:
        scale = self.scale(now)
        self._own[tenant] = self._own.get(tenant, 0.0) + tokens * scale
        self._own.move_to_end(tenant)

    def lift(self, tenant: str, floor: float) -> None:
        """Raise `tenant`'s scaled total to at least `floor`."""
        short = floor - self.total(tenant)
        if short > 0:
            self._own[tenant] = self._own.get(tenant, 0.0) + short

    def own(self, now: float, limit: int) -> dict[str, float]:
        """This replica's usage in tokens decayed to `now`, the `limit` largest above a
        hundredth of a token (what is shared)."""
        scale = self.scale(now)
        largest = sorted(self._own.items(), key=lambda item: item[1], reverse=True)[:limit]
        return {t: v / scale for t, v in largest if v / scale >= 0.01}

    def set_others(self, usage: Mapping[str, float], now: float) -> None:
        """The other replicas' usage in tokens as of `now` (summed over them)."""
        scale = self.scale(now)
        self._others = {t: v * scale for t, v in usage.items()}
