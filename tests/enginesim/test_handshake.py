from __future__ import annotations

import pytest

from enginesim.handshake import (
    DecodeAddress,
    HandshakeError,
    KVMetadata,
    RankId,
    Registration,
    RoomRequest,
    StatusMessage,
    parse_status,
    parse_to_prefill,
    registration_frames,
    room_request_frames,
    status_frames,
)

DECODE = DecodeAddress("10.0.0.7", 40123, "decode-abc")
RANK = RankId(1, 0, 2)


def test_decode_messages_round_trip() -> None:
    assert parse_to_prefill(registration_frames(DECODE)) == Registration(DECODE)
    assert registration_frames(DECODE)[0] == b"None"
    assert parse_to_prefill(room_request_frames(2**63 - 1, DECODE)) == RoomRequest(
        2**63 - 1, DECODE
    )


@pytest.mark.parametrize(
    "message",
    [
        StatusMessage(42, "waiting", RANK),
        StatusMessage(42, "success", RANK, metadata=KVMetadata(42, 64, 100, 7, 1500, 30000)),
        StatusMessage(42, "success", RANK, metadata=KVMetadata(0, 0, 1, 0, 0, 0)),
        StatusMessage(42, "failed", RANK, reason="injected failure"),
    ],
)
def test_status_messages_round_trip(message: StatusMessage) -> None:
    assert parse_status(status_frames(message)) == message


def test_room_is_slot_zero_of_the_metadata_frames() -> None:
    frames = status_frames(
        StatusMessage(42, "success", RANK, metadata=KVMetadata(43, 1, 2, 3, 4, 5))
    )
    assert frames[:4] == [b"42", b"success", b"1.0.2", b"43"]


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([b"None", b"ip", b"1"], "bad_frames"),
        ([b"0", b"ip", b"1", b"s"], "bad_room"),
        ([str(2**63).encode(), b"ip", b"1", b"s"], "bad_room"),
        ([b"-5", b"ip", b"1", b"s"], "bad_room"),
        ([b"5", b"", b"1", b"s"], "bad_ip"),
        ([b"5", b"\xff\xfe", b"1", b"s"], "bad_ip"),
        ([b"5", b"ip", b"70000", b"s"], "bad_port"),
        ([b"5", b"ip", b"1e3", b"s"], "bad_port"),
    ],
)
def test_malformed_decode_messages_raise_with_a_reason(frames: list[bytes], reason: str) -> None:
    with pytest.raises(HandshakeError) as info:
        parse_to_prefill(frames)
    assert info.value.reason == reason


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([b"5", b"waiting"], "bad_frames"),
        ([b"5", b"done", b"0.0.0"], "bad_status"),
        ([b"5", b"waiting", b"0.0"], "bad_rank"),
        ([b"5", b"waiting", b"0.0.0", b"extra"], "bad_frames"),
        ([b"5", b"success", b"0.0.0", b"5"], "bad_frames"),
        ([b"5", b"success", b"0.0.0", b"5", b"1", b"2", b"3", b"4", b"x"], "bad_metadata"),
        ([b"5", b"failed", b"0.0.0"], "bad_frames"),
    ],
)
def test_malformed_status_messages_raise_with_a_reason(frames: list[bytes], reason: str) -> None:
    with pytest.raises(HandshakeError) as info:
        parse_status(frames)
    assert info.value.reason == reason
