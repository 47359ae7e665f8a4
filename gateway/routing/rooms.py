"""Rooms: the number that binds a request's prefill and decode halves (SGLang's bootstrap room).

A room must not repeat among requests in flight, but nothing is guarded by its secrecy
(clients cannot set it), so rooms come from a `random.Random` seeded by the OS, not from
a system call each.
"""

from __future__ import annotations

from random import Random

MAX_ROOM = 2**63 - 1


def draw_room(rng: Random, dp_size: int | None = None, dp_rank: int | None = None) -> int:
    """A room in [1, 2^63-1]; with a DP rank, one whose `room % dp_size == dp_rank`.

    Room 0 is never drawn: a decode reads 0 as "KV metadata not written yet".
    """
    if dp_size is None or dp_size <= 1 or dp_rank is None:
        # Uniform over [1, MAX_ROOM] as randint would be, for a tenth of its instructions:
        # the room is drawn for every request.
        room = rng.getrandbits(63)
        while not room:
            room = rng.getrandbits(63)
        return room
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is outside dp_size {dp_size}")
    lowest = 1 if dp_rank == 0 else 0
    return rng.randint(lowest, (MAX_ROOM - dp_rank) // dp_size) * dp_size + dp_rank
