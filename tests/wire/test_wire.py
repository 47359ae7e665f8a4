"""Golden bytes and shapes of `docs/protocols.md` §4, and a decoder that never crashes."""

from __future__ import annotations

from array import array

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from globalkv.keys import EngineHash
from globalkv.wire import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    Frame,
    WireError,
    decode_batch,
    encode_batch,
    live_frames,
    parse_live,
    parse_replay_reply,
    parse_replay_request,
    replay_end,
    replay_reply,
    replay_request,
)
from globalkv.wire.decode import MAX_BATCH_EVENTS, MAX_BATCH_FIELDS

SGLANG_0_5_23_HEX = (
    "93cb3ff80000000000009387a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392fe07"
    "b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739401020304aa626c6f636b5f73697a65"
    "02a76c6f72615f6964c0a66d656469756da347505583a474797065ac426c6f636b52656d6f766564ac626c6f63"
    "6b5f6861736865739107a66d656469756da347505581a474797065b0416c6c426c6f636b73436c656172656400"
)
VLLM_0_18_ARRAY = [
    1.5,
    [
        ["BlockStored", [2**64 - 2, 7], None, [1, 2, 3, 4], 2, None, "GPU", None, None, 0],
        ["BlockRemoved", [7], "GPU", 0],
        ["AllBlocksCleared"],
    ],
    0,
]
H = EngineHash
GOLDEN_BATCH = EventBatch(
    ts=1.5,
    events=[
        BlockStored(
            block_hashes=(H(2**64 - 2), H(7)),
            parent_block_hash=None,
            token_ids=[1, 2, 3, 4],
            block_size=2,
            medium="GPU",
        ),
        BlockRemoved(block_hashes=(H(7),), medium="GPU"),
        AllBlocksCleared(),
    ],
    dp_rank=0,
)


def _normalised(batch: EventBatch) -> list[object]:
    """A comparable form: token arrays as lists."""
    out: list[object] = [batch.ts, batch.dp_rank]
    for e in batch.events:
        if isinstance(e, BlockStored):
            out.append((list(e.block_hashes), e.parent_block_hash, list(e.token_ids), e.block_size))
            out.append((e.lora_id, e.medium, e.lora_name, e.group_idx, e.cache_salt))
        else:
            out.append(e)
    return out


def test_sglang_golden_bytes_decode() -> None:
    batch = decode_batch(bytes.fromhex(SGLANG_0_5_23_HEX))
    assert _normalised(batch) == _normalised(GOLDEN_BATCH)
    stored = batch.events[0]
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == (2**64 - 2, 7)
    assert isinstance(stored.token_ids, array)


def test_sglang_encoder_produces_the_golden_bytes() -> None:
    assert encode_batch(GOLDEN_BATCH, "sglang").hex() == SGLANG_0_5_23_HEX


def test_vllm_array_form_decodes_to_the_same_batch() -> None:
    payload = msgpack.packb(VLLM_0_18_ARRAY)
    assert _normalised(decode_batch(payload)) == _normalised(GOLDEN_BATCH)


def test_vllm_array_encoder_produces_the_documented_form() -> None:
    assert msgpack.unpackb(encode_batch(GOLDEN_BATCH, "vllm-array")) == VLLM_0_18_ARRAY


def test_vllm_map_encoder_keeps_nil_fields_unsigned_hashes_and_the_group() -> None:
    raw = msgpack.unpackb(encode_batch(GOLDEN_BATCH, "vllm"))
    assert raw[0] == 1.5
    assert raw[2] == 0
    assert raw[1][0] == {
        "type": "BlockStored",
        "block_hashes": [2**64 - 2, 7],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
    }
    assert raw[1][1] == {
        "type": "BlockRemoved",
        "block_hashes": [7],
        "medium": "GPU",
        "group_idx": 0,
    }
    assert raw[1][2] == {"type": "AllBlocksCleared"}


@pytest.mark.parametrize("flavor", ["vllm", "vllm-array", "sglang"])
def test_every_flavor_round_trips(flavor: str) -> None:
    batch = EventBatch(
        ts=2.25,
        events=[
            BlockStored(
                block_hashes=(H(2**63 + 5), H(3)),
                parent_block_hash=H(2**64 - 1),
                token_ids=list(range(8)),
                block_size=4,
                lora_id=3,
                medium="CPU",
                lora_name=None if flavor == "sglang" else "adapter",
            ),
            BlockRemoved(block_hashes=(H(3),), medium="CPU"),
        ],
        dp_rank=None,
    )
    assert _normalised(decode_batch(encode_batch(batch, flavor))) == _normalised(batch)  # type: ignore[arg-type]


def test_unknown_flavor_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown flavor"):
        encode_batch(GOLDEN_BATCH, "tgi")  # type: ignore[arg-type]


def test_vllm_0_9_shapes_two_element_batch_and_short_events() -> None:
    payload = msgpack.packb(
        [3.0, [["BlockStored", [1, 2], None, [5] * 32, 16, None], ["BlockRemoved", [2]]]]
    )
    batch = decode_batch(payload)
    assert batch.dp_rank is None
    stored, removed = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.medium is None
    assert stored.lora_id is None
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == (2,)
    assert removed.medium is None


def test_extra_positions_and_unknown_fields_are_ignored() -> None:
    payload = msgpack.packb(
        [
            1.0,
            [
                ["BlockStored", [1], 9, [1, 2], 2, None, "GPU", "lora", None, 1, "future", 42],
                {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "new_field": [1]},
                ["AllBlocksCleared", "extra"],
            ],
            2,
            "an extra batch position",
        ]
    )
    batch = decode_batch(payload)
    stored = batch.events[0]
    assert isinstance(stored, BlockStored)
    assert (stored.parent_block_hash, stored.lora_name, stored.group_idx) == (9, "lora", 1)
    assert batch.dp_rank == 2
    assert len(batch.events) == 3


def test_map_batch_is_accepted() -> None:
    payload = msgpack.packb(
        {"ts": 4, "events": [{"type": "AllBlocksCleared"}], "data_parallel_rank": 1}
    )
    assert decode_batch(payload) == EventBatch(ts=4.0, events=[AllBlocksCleared()], dp_rank=1)


def test_newer_store_fields_and_remote_locality() -> None:
    local = {
        "type": "BlockStored",
        "block_hashes": [b"\x00" * 24 + b"\x00\x00\x00\x00\x00\x00\x01\x02"],
        "parent_block_hash": b"\xff" * 32,
        "token_ids": [1, 2],
        "block_size": 2,
        "cache_salt": "salt",
        "locality": "LOCAL",
        "session_id": "s",
        "lookahead_token_ids": [3],
    }
    remote = {**local, "locality": "REMOTE"}
    batch = decode_batch(msgpack.packb([1.0, [local, remote, ["SomethingNew", 1]], 0]))
    assert batch.skipped == 2
    (stored,) = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == (0x0102,)
    assert stored.parent_block_hash == 2**64 - 1
    assert stored.cache_salt == "salt"


def test_signed_and_bytes_hashes_normalise_to_the_same_value() -> None:
    digest = bytes(range(32))
    as_int = int.from_bytes(digest[-8:], "big")
    signed = as_int - 2**64 if as_int >= 2**63 else as_int
    for value in (digest, as_int, signed):
        event = ["BlockRemoved", [value]]
        (removed,) = decode_batch(msgpack.packb([0.0, [event]])).events
        assert isinstance(removed, BlockRemoved)
        assert removed.block_hashes == (as_int,)


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\xc1", "not_msgpack"),
        (b"", "not_msgpack"),
        (msgpack.packb([1.0, []]) + b"\x00", "not_msgpack"),
        (msgpack.packb(5), "bad_batch"),
        (msgpack.packb([1.0]), "bad_batch"),
        (msgpack.packb(["x", []]), "bad_batch"),
        (msgpack.packb([float("nan"), []]), "bad_batch"),
        (msgpack.packb([1.0, {}]), "bad_batch"),
        (msgpack.packb([1.0, [], -1]), "bad_batch"),
        (msgpack.packb([1.0, [], "0"]), "bad_batch"),
        (msgpack.packb([1.0, [7]]), "bad_event"),
        (msgpack.packb([1.0, [[]]]), "bad_event"),
        (msgpack.packb([1.0, [{"type": 1}]]), "bad_event"),
        (msgpack.packb([1.0, [["BlockRemoved", 5]]]), "bad_hash"),
        (msgpack.packb([1.0, [["BlockRemoved", [1.5]]]]), "bad_hash"),
        (msgpack.packb([1.0, [["BlockRemoved", [b""]]]]), "bad_hash"),
        (msgpack.packb([1.0, [["BlockRemoved", [True]]]]), "bad_hash"),
        (msgpack.packb([1.0, [["BlockStored", [1], "p", [1], 1]]]), "bad_hash"),
        (msgpack.packb([1.0, [["BlockStored", [1], None, [-1], 1]]]), "bad_tokens"),
        (msgpack.packb([1.0, [["BlockStored", [1], None, [2**32], 1]]]), "bad_tokens"),
        (msgpack.packb([1.0, [["BlockStored", [1], None, ["a"], 1]]]), "bad_tokens"),
        (msgpack.packb([1.0, [["BlockStored", [1], None, 3, 1]]]), "bad_tokens"),
        (msgpack.packb([1.0, [["BlockStored", [1], None, [1], 0]]]), "bad_field"),
        (msgpack.packb([1.0, [["BlockStored", [1], None, [1], 1, "x"]]]), "bad_field"),
        (msgpack.packb([1.0, [["BlockStored", [1], None, [1], 1, None, 5]]]), "bad_field"),
        (msgpack.packb([1.0, [["BlockRemoved", [1], None, -2]]]), "bad_field"),
    ],
)
def test_malformed_payloads_raise_one_typed_error(payload: bytes, reason: str) -> None:
    with pytest.raises(WireError) as info:
        decode_batch(payload)
    assert info.value.reason == reason
    assert info.value.detail


@pytest.mark.parametrize("form", ["array", "map"])
def test_a_batch_of_too_many_events_is_refused_before_they_are_built(form: str) -> None:
    def batch(n: int) -> bytes:
        events = [["AllBlocksCleared"]] * n
        return msgpack.packb([1.0, events] if form == "array" else {"ts": 1.0, "events": events})

    assert len(decode_batch(batch(MAX_BATCH_EVENTS)).events) == MAX_BATCH_EVENTS
    with pytest.raises(WireError, match=f"more than {MAX_BATCH_EVENTS}") as info:
        decode_batch(batch(MAX_BATCH_EVENTS + 1))
    assert info.value.reason == "bad_batch"


def test_a_map_batch_naming_events_twice_is_bounded_by_either() -> None:
    few, many = [["AllBlocksCleared"]], [["AllBlocksCleared"]] * (MAX_BATCH_EVENTS + 1)
    for first, last in (few, many), (many, few):
        # By hand: a dict cannot hold a key twice; msgpack keeps the last one.
        parts = ("ts", 1.0, "events", first, "events", last)
        payload = b"\x83" + b"".join(msgpack.packb(part) for part in parts)
        with pytest.raises(WireError, match="more than") as info:
            decode_batch(payload)
        assert info.value.reason == "bad_batch"


def test_a_map_batch_of_too_many_fields_is_refused() -> None:
    fields = {f"f{i}": i for i in range(MAX_BATCH_FIELDS - 2)}
    assert decode_batch(msgpack.packb({"ts": 1.0, "events": [], **fields})).events == []
    with pytest.raises(WireError, match="entries") as info:
        decode_batch(msgpack.packb({"ts": 1.0, "events": [], **fields, "one": 1, "more": 2}))
    assert info.value.reason == "bad_batch"


def test_live_frames_round_trip() -> None:
    frames = live_frames("kv@p0@m", 2**40, b"payload")
    assert frames[1] == (2**40).to_bytes(8, "big")
    assert parse_live(frames) == Frame(b"kv@p0@m", 2**40, b"payload")


@pytest.mark.parametrize(
    "frames", [[b"t", b"\x00" * 8], [b"t", b"\x00" * 7, b"p"], [b"", b"", b"", b""]]
)
def test_bad_live_frames(frames: list[bytes]) -> None:
    with pytest.raises(WireError):
        parse_live(frames)


def test_replay_request_and_both_reply_layouts() -> None:
    assert replay_request(5) == [b"", b"\x00" * 7 + b"\x05"]
    assert parse_replay_request(replay_request(5)) == 5
    frame = Frame(b"kv@p@m", 3, b"x")
    old = replay_reply(frame, "seq")
    new = replay_reply(frame, "topic")
    assert old == [b"", frame.seq.to_bytes(8, "big"), b"x"]
    assert new == [b"", b"kv@p@m", frame.seq.to_bytes(8, "big"), b"x"]
    assert parse_replay_reply(old) == Frame(b"", 3, b"x")
    assert parse_replay_reply(new) == frame
    assert replay_end("seq") == [b"", END_SEQ, b""]
    assert replay_end("topic") == [b"", b"", END_SEQ, b""]
    assert END_SEQ == b"\xff" * 8
    assert parse_replay_reply(replay_end("seq")) is None
    assert parse_replay_reply(replay_end("topic")) is None


@pytest.mark.parametrize(
    "frames", [[b"x", b"\x00" * 8, b""], [b""], [b"", b"\x00", b""], [b"", b"", b"", b"", b""]]
)
def test_bad_replay_replies(frames: list[bytes]) -> None:
    with pytest.raises(WireError):
        parse_replay_reply(frames)


def test_bad_replay_request() -> None:
    with pytest.raises(WireError):
        parse_replay_request([b"x", b"\x00" * 8])


_leaf = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=40)
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type", "REMOTE"])
)
_msgpack_values = st.recursive(
    _leaf,
    lambda children: (
        st.lists(children, max_size=12)
        | st.dictionaries(
            st.sampled_from(["type", "block_hashes", "token_ids", "block_size", "ts", "events"])
            | st.text(max_size=6),
            children,
            max_size=8,
        )
    ),
    max_leaves=60,
)


WIRE_REASONS = {"not_msgpack", "bad_batch", "bad_event", "bad_hash", "bad_tokens", "bad_field"}


def _decode_or_wire_error(payload: bytes) -> None:
    try:
        batch = decode_batch(payload)
    except WireError as exc:
        reason = exc.reason
        assert reason in WIRE_REASONS
        return
    assert isinstance(batch, EventBatch)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_any_bytes_decode_or_raise_wire_error(payload: bytes) -> None:
    _decode_or_wire_error(payload)


@settings(max_examples=300, deadline=None)
@given(_msgpack_values)
def test_fuzz_any_msgpack_structure_decodes_or_raises_wire_error(value: object) -> None:
    _decode_or_wire_error(msgpack.packb(value))


@settings(max_examples=150, deadline=None)
@given(st.lists(_msgpack_values, max_size=6), st.floats(allow_nan=False), st.none() | st.integers())
def test_fuzz_batches_of_arbitrary_events(events: list[object], ts: float, dp: int | None) -> None:
    payload = msgpack.packb([ts, events, dp]) if dp is None or -(2**63) <= dp < 2**64 else b""
    _decode_or_wire_error(payload)
