"""The prefill ⇄ decode messages (PROTOCOLS §3), as ZMQ frames of ASCII decimal integers.

The four steps, with the room carried end to end:

1. decode → each target prefill rank, once per address: `[b"None", decode_ip, decode_port,
   session]`, so the rank knows where that decode listens;
2. decode → prefill rank, per request: `[room, decode_ip, decode_port, session]`; the rank
   answers at once with a `waiting` status, which is how the decode observes "connected";
3. prefill rank → decode when the KV is "written": `[room, b"success", rank, *metadata]`
   where metadata slot 0 holds the room the prefill wrote (SGLang's metadata buffer), then
   the cached-token count, prompt length, first output token and the prefill's queue and
   compute times in microseconds; or `[room, b"failed", rank, reason]`;
4. the decode checks metadata slot 0: 0 → not ready, another room → mismatch.

The layout is ours, not SGLang's byte for byte (real KV moves over RDMA), but every step
exists, so every stage can fail and be observed. Parsing validates every frame:
malformed input raises `HandshakeError` with a short reason for the drop counter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

REGISTER_TAG = b"None"
MAX_ROOM = 2**63 - 1
Status = Literal["waiting", "success", "failed"]
_STATUSES: tuple[Status, ...] = ("waiting", "success", "failed")
_MAX_TEXT = 1024


class HandshakeError(ValueError):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True, order=True)
class RankId:
    """A prefill rank of one instance (cp is always 0 in the emulator)."""

    dp: int
    tp: int
    pp: int

    def label(self) -> str:
        return f"{self.dp}.{self.tp}.{self.pp}"

    @classmethod
    def parse(cls, label: bytes) -> RankId:
        parts = label.split(b".")
        if len(parts) != 3:
            raise HandshakeError("bad_rank", f"rank label {label[:40]!r}")
        dp, tp, pp = (_int(part, "rank") for part in parts)
        return cls(dp, tp, pp)


@dataclass(frozen=True, slots=True)
class DecodeAddress:
    ip: str
    port: int
    session: str


@dataclass(frozen=True, slots=True)
class Registration:
    """Step 1."""

    decode: DecodeAddress


@dataclass(frozen=True, slots=True)
class RoomRequest:
    """Step 2."""

    room: int
    decode: DecodeAddress


InboundToPrefill = Registration | RoomRequest


@dataclass(frozen=True, slots=True)
class KVMetadata:
    room: int
    """Slot 0: the room the prefill wrote; the decode compares it with its own."""
    cached_tokens: int
    prompt_tokens: int
    first_token: int
    queue_us: int
    prefill_us: int

    @classmethod
    def computed(
        cls, room: int, cached: int, prompt_tokens: int, first_token: int, meta: dict[str, Any]
    ) -> KVMetadata:
        """What a prefill tells the decode of a prompt it computed (`meta`: its timings)."""
        return cls(
            room=room,
            cached_tokens=cached,
            prompt_tokens=prompt_tokens,
            first_token=first_token,
            queue_us=round(meta["queue_ms"] * 1000),
            prefill_us=round(meta["prefill_ms"] * 1000),
        )


@dataclass(frozen=True, slots=True)
class StatusMessage:
    """Step 3 (and the step-2 acknowledgement, status `waiting`)."""

    room: int
    status: Status
    rank: RankId
    metadata: KVMetadata | None = None
    reason: str = ""


def _int(frame: bytes, what: str, *, lo: int = 0, hi: int = 2**64 - 1) -> int:
    if not frame or len(frame) > 20 or not frame.isdigit():
        raise HandshakeError(f"bad_{what}", f"{what} frame {frame[:40]!r} is not a decimal")
    value = int(frame)
    if not lo <= value <= hi:
        raise HandshakeError(f"bad_{what}", f"{what} {value} out of range")
    return value


def _text(frame: bytes, what: str) -> str:
    if not frame or len(frame) > _MAX_TEXT:
        raise HandshakeError(f"bad_{what}", f"{what} frame of {len(frame)} bytes")
    try:
        return frame.decode()
    except UnicodeDecodeError:
        raise HandshakeError(f"bad_{what}", f"{what} is not UTF-8") from None


def _num(value: int) -> bytes:
    return str(value).encode()


def registration_frames(decode: DecodeAddress) -> list[bytes]:
    return [REGISTER_TAG, decode.ip.encode(), _num(decode.port), decode.session.encode()]


def room_request_frames(room: int, decode: DecodeAddress) -> list[bytes]:
    return [_num(room), decode.ip.encode(), _num(decode.port), decode.session.encode()]


def parse_to_prefill(frames: Sequence[bytes]) -> InboundToPrefill:
    if len(frames) != 4:
        raise HandshakeError("bad_frames", f"{len(frames)} frames, need 4")
    decode = DecodeAddress(
        ip=_text(frames[1], "ip"),
        port=_int(frames[2], "port", lo=1, hi=65535),
        session=_text(frames[3], "session"),
    )
    if frames[0] == REGISTER_TAG:
        return Registration(decode)
    return RoomRequest(_int(frames[0], "room", lo=1, hi=MAX_ROOM), decode)


def status_frames(message: StatusMessage) -> list[bytes]:
    head = [_num(message.room), message.status.encode(), message.rank.label().encode()]
    if message.status == "success":
        meta = message.metadata
        assert meta is not None, "a success status carries metadata"
        return [
            *head,
            _num(meta.room),
            _num(meta.cached_tokens),
            _num(meta.prompt_tokens),
            _num(meta.first_token),
            _num(meta.queue_us),
            _num(meta.prefill_us),
        ]
    if message.status == "failed":
        return [*head, message.reason.encode()[:_MAX_TEXT] or b"failed"]
    return head


def parse_status(frames: Sequence[bytes]) -> StatusMessage:
    if len(frames) < 3:
        raise HandshakeError("bad_frames", f"{len(frames)} frames, need at least 3")
    room = _int(frames[0], "room", lo=1, hi=MAX_ROOM)
    status = frames[1].decode(errors="replace")
    if status not in _STATUSES:
        raise HandshakeError("bad_status", f"status {frames[1][:40]!r}")
    rank = RankId.parse(frames[2])
    if status == "waiting":
        if len(frames) != 3:
            raise HandshakeError("bad_frames", f"waiting with {len(frames)} frames")
        return StatusMessage(room, "waiting", rank)
    if status == "failed":
        if len(frames) != 4:
            raise HandshakeError("bad_frames", f"failed with {len(frames)} frames")
        return StatusMessage(room, "failed", rank, reason=_text(frames[3], "reason"))
    if len(frames) != 9:
        raise HandshakeError("bad_frames", f"success with {len(frames)} frames, need 9")
    meta_room, cached, prompt, first, queue_us, prefill_us = (
        _int(frame, "metadata") for frame in frames[3:]
    )
    metadata = KVMetadata(meta_room, cached, prompt, first, queue_us, prefill_us)
    return StatusMessage(room, "success", rank, metadata=metadata)
