"""The ZMQ frames around a payload (`docs/protocols.md` §4.1): live and replay, both layouts."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from globalkv.wire.events import WireError

_SEQ = struct.Struct(">Q")
_SIGNED_SEQ = struct.Struct(">q")
END_SEQ = _SIGNED_SEQ.pack(-1)
"""The replay end marker's seq frame: -1 as a signed 8-byte big-endian int."""

ReplayLayout = Literal["seq", "topic"]
"""`seq`: `[b"", seq, payload]` (vLLM ≤ 0.25, SGLang ≤ 0.5.21);
`topic`: `[b"", topic, seq, payload]` (vLLM ≥ 0.26, SGLang ≥ 0.5.22)."""


@dataclass(frozen=True, slots=True)
class Frame:
    """One batch as it travels: live on PUB/SUB, or as a replay reply."""

    topic: bytes
    seq: int
    payload: bytes


def pack_seq(seq: int) -> bytes:
    return _SEQ.pack(seq)


def unpack_seq(data: bytes) -> int:
    if len(data) != 8:
        raise WireError("bad_seq", f"seq frame of {len(data)} bytes, need 8")
    value: int = _SEQ.unpack(data)[0]
    return value


def live_frames(topic: bytes | str, seq: int, payload: bytes) -> list[bytes]:
    """`[topic, seq, payload]` as a PUB socket sends it."""
    topic_bytes = topic.encode() if isinstance(topic, str) else topic
    return [topic_bytes, pack_seq(seq), payload]


def parse_live(frames: Sequence[bytes]) -> Frame:
    if len(frames) != 3:
        raise WireError("bad_frames", f"live message of {len(frames)} frames, need 3")
    return Frame(topic=bytes(frames[0]), seq=unpack_seq(frames[1]), payload=bytes(frames[2]))


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends to a replay ROUTER: `[b"", start_seq]`."""
    return [b"", pack_seq(start_seq)]


def parse_replay_request(frames: Sequence[bytes]) -> int:
    """The start seq of a request as a ROUTER receives it (identity frame removed)."""
    if len(frames) != 2 or frames[0] != b"":
        raise WireError("bad_frames", f"replay request of {len(frames)} frames")
    return unpack_seq(frames[1])


def replay_reply(frame: Frame, layout: ReplayLayout) -> list[bytes]:
    """One buffered batch as a replay ROUTER answers (identity frame not included)."""
    if layout == "seq":
        return [b"", pack_seq(frame.seq), frame.payload]
    return [b"", frame.topic, pack_seq(frame.seq), frame.payload]


def replay_end(layout: ReplayLayout) -> list[bytes]:
    if layout == "seq":
        return [b"", END_SEQ, b""]
    return [b"", b"", END_SEQ, b""]


def parse_replay_reply(frames: Sequence[bytes]) -> Frame | None:
    """A replay reply in either layout as a DEALER receives it; None for the end marker."""
    if len(frames) == 3 and frames[0] == b"":
        topic, seq, payload = b"", frames[1], frames[2]
    elif len(frames) == 4 and frames[0] == b"":
        topic, seq, payload = frames[1], frames[2], frames[3]
    else:
        raise WireError("bad_frames", f"replay reply of {len(frames)} frames")
    if seq == END_SEQ:
        return None
    return Frame(topic=bytes(topic), seq=unpack_seq(seq), payload=bytes(payload))
