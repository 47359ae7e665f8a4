"""A pair chosen for one attempt, as the legs run it: what the router (or a decode's
sidecar, or the decider) decided, without the router that decided it, so the legs and
anything else that runs a plan import no router."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.policies.base import Choice
from gateway.workers.pool import Worker


# Built per request: its own __init__, compiled where the module is (the dataclass gives
# eq and repr only; its generated __init__ runs interpreted): docs/gateway-design.md.
@dataclass(slots=True, init=False)
class RoutePlan:
    prefill: Worker
    decode: Worker
    prefill_choice: Choice
    rooms: list[int]
    keys: Sequence[int]
    """The prompt's block keys, recorded as pending on the prefill while it computes them."""
    local: bool
    """The decode prefills the prompt itself (`gateway.routing.decider`): `prefill` is the
    decode too, `prefill_choice` what it holds and computes, and there are no rooms."""
    pinned_dp_rank: int | None
    """With `--dp-aware`, the DP rank named in the request itself where the room cannot
    select it (the prefill does not follow the room)."""
    dp_rank: int | None = field(init=False)
    """The prefill's DP rank that computes the prompt, where it is known: the prefill's
    rule (`Directory.computing_rank`) applied to the first room and the pinned rank, the
    same for every plan, those without rooms (a local plan's, an endpoint picker's: its
    decode's sidecar draws them) included."""

    def __init__(
        self,
        prefill: Worker,
        decode: Worker,
        prefill_choice: Choice,
        rooms: list[int],
        keys: Sequence[int] = (),
        local: bool = False,
        pinned_dp_rank: int | None = None,
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.prefill_choice = prefill_choice
        self.rooms = rooms
        self.keys = keys
        self.local = local
        self.pinned_dp_rank = pinned_dp_rank
        room = rooms[0] if rooms else None
        self.dp_rank = prefill.directory.computing_rank(room, pinned_dp_rank)
