from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from enginesim.handshake import (
    DecodeAddress,
    KVMetadata,
    RankId,
    registration_frames,
    room_request_frames,
)
from enginesim.metrics import EngineMetrics
from enginesim.peer_sockets import PushPool, bind_pull
from enginesim.transfer import DecodeTransfer, PrefillTransfer, TransferError
from tests.support.net import free_port

RANKS = [RankId(0, 0, 0), RankId(0, 1, 0)]
META = KVMetadata(
    room=77, cached_tokens=32, prompt_tokens=50, first_token=9, queue_us=1, prefill_us=2
)


class Pair:
    def __init__(self, context: zmq.asyncio.Context) -> None:
        self.registry = CollectorRegistry()
        metrics = EngineMetrics(self.registry)
        self.prefill = PrefillTransfer(
            context, metrics, RANKS, bind_host="127.0.0.1", advertise_host="127.0.0.1"
        )
        self.decode = DecodeTransfer(
            context,
            metrics,
            bind_host="127.0.0.1",
            advertise_host="127.0.0.1",
            session="decode-1",
        )
        self.context = context
        self.connected: list[int] = []
        self.any_connected = asyncio.Event()

    def dropped(self, reason: str) -> float | None:
        return self.registry.get_sample_value(
            "globalkv_engine_transfer_messages_dropped_total", {"reason": reason}
        )

    async def exchange(
        self, room: int, *, connect_timeout: float = 10.0, transfer_timeout: float = 10.0
    ) -> dict[RankId, KVMetadata]:
        return await self.decode.exchange(
            room,
            self.prefill.addresses,
            connect_timeout=connect_timeout,
            transfer_timeout=transfer_timeout,
            on_connected=lambda: self._on_connected(room),
        )

    def _on_connected(self, room: int) -> None:
        self.connected.append(room)
        self.any_connected.set()


@pytest.fixture
async def pair(context: zmq.asyncio.Context) -> AsyncIterator[Pair]:
    pair = Pair(context)
    await pair.prefill.start()
    await pair.decode.start()
    yield pair
    await pair.decode.stop()
    await pair.prefill.stop()


async def serve_room(pair: Pair, room: int, metadata: KVMetadata = META) -> None:
    dests = await pair.prefill.wait_for_decode(room, RANKS, timeout=10)
    await pair.prefill.send_ready(room, dests, metadata)


async def test_decode_receives_every_target_ranks_metadata(pair: Pair) -> None:
    got, _ = await asyncio.gather(pair.exchange(77), serve_room(pair, 77))
    assert got == {rank: META for rank in RANKS}
    assert pair.connected == [77]


async def test_decode_arriving_before_the_prefill_request_is_kept(pair: Pair) -> None:
    decode = asyncio.create_task(pair.exchange(77))
    await pair.any_connected.wait()
    await serve_room(pair, 77)
    assert len(await decode) == 2


async def test_metadata_room_is_passed_through_unchecked(pair: Pair) -> None:
    wrong = KVMetadata(78, 0, 1, 0, 0, 0)
    got, _ = await asyncio.gather(pair.exchange(77), serve_room(pair, 77, wrong))
    assert {m.room for m in got.values()} == {78}


async def test_prefill_without_a_decode_fails_the_handshake_stage(pair: Pair) -> None:
    with pytest.raises(TransferError) as info:
        await pair.prefill.wait_for_decode(5, RANKS, timeout=0.2)
    assert info.value.stage == "handshake"
    assert "no decode handshake for bootstrap_room 5" in str(info.value)


async def test_prefill_failure_reaches_a_waiting_decode(pair: Pair) -> None:
    decode = asyncio.create_task(pair.exchange(77))
    await pair.any_connected.wait()
    await pair.prefill.fail(77, "injected failure")
    with pytest.raises(TransferError) as info:
        await decode
    assert info.value.stage == "transfer"
    assert "injected failure" in str(info.value)


async def test_prefill_failure_after_the_handshake_reaches_the_decode(pair: Pair) -> None:
    decode = asyncio.create_task(pair.exchange(77))
    await pair.prefill.wait_for_decode(77, RANKS, timeout=10)
    await pair.prefill.fail(77, "prefill request cancelled")
    with pytest.raises(TransferError) as info:
        await decode
    assert info.value.stage == "transfer"
    assert "prefill request cancelled" in str(info.value)


async def test_a_handshake_timeout_is_told_to_the_decode_ranks_that_did_arrive(
    pair: Pair,
) -> None:
    one_rank = {RANKS[0]: pair.prefill.addresses[RANKS[0]]}
    connected = asyncio.Event()
    decode = asyncio.create_task(
        pair.decode.exchange(
            78, one_rank, connect_timeout=10, transfer_timeout=10, on_connected=connected.set
        )
    )
    await connected.wait()
    with pytest.raises(TransferError, match=r"on prefill ranks 0\.1\.0 within"):
        await pair.prefill.wait_for_decode(78, RANKS, timeout=0.2)
    await pair.prefill.fail(78, "prefill handshake stage: no decode")
    with pytest.raises(TransferError, match="prefill handshake stage: no decode"):
        await decode


async def test_prefill_failure_reaches_a_late_decode_at_once(pair: Pair) -> None:
    await pair.prefill.fail(77, "prefill overloaded")
    with pytest.raises(TransferError) as info:
        await pair.exchange(77)
    assert info.value.stage == "connect"
    assert "prefill overloaded" in str(info.value)


async def test_dead_prefill_rank_fails_the_connect_stage(pair: Pair) -> None:
    dead = {RankId(0, 0, 0): ("127.0.0.1", free_port())}
    with pytest.raises(TransferError) as info:
        await pair.decode.exchange(
            9, dead, connect_timeout=0.2, transfer_timeout=1, on_connected=lambda: None
        )
    assert info.value.stage == "connect"
    assert "no answer for bootstrap_room 9 from prefill ranks 0.0.0" in str(info.value)


async def test_no_kv_ready_in_time_fails_the_transfer_stage(pair: Pair) -> None:
    with pytest.raises(TransferError) as info:
        await pair.exchange(77, transfer_timeout=0.2)
    assert info.value.stage == "transfer"
    assert pair.connected == [77]


async def test_same_room_twice_in_flight_is_refused(pair: Pair) -> None:
    first = asyncio.create_task(pair.exchange(77))
    await pair.any_connected.wait()
    with pytest.raises(TransferError, match="already in flight"):
        await pair.exchange(77)
    await serve_room(pair, 77)
    await first


async def test_garbage_and_unregistered_sessions_are_dropped_and_ranks_keep_working(
    pair: Pair,
) -> None:
    context = pair.context
    listener, port = bind_pull(context, "127.0.0.1")
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    ip, rank_port = pair.prefill.addresses[RANKS[0]]
    push.connect(f"tcp://{ip}:{rank_port}")
    await push.send_multipart([b"garbage"])
    stranger = DecodeAddress("127.0.0.1", port, "never-registered")
    await push.send_multipart(room_request_frames(11, stranger))
    reply = await asyncio.wait_for(listener.recv_multipart(), 10)
    assert reply[:2] == [b"11", b"failed"]
    assert b"never registered" in reply[3]
    await push.send_multipart(registration_frames(stranger))
    got, _ = await asyncio.gather(pair.exchange(77), serve_room(pair, 77))
    assert len(got) == 2
    assert pair.dropped("bad_frames") == 1
    push.close()
    listener.close()


async def test_stop_waiting_ends_the_prefills_handshake_waits_and_refuses_new_ones(
    pair: Pair,
) -> None:
    waiting = asyncio.create_task(pair.prefill.wait_for_decode(5, RANKS, timeout=600))
    await asyncio.sleep(0)
    pair.prefill.stop_waiting()
    for wait in (waiting, pair.prefill.wait_for_decode(6, RANKS, timeout=600)):
        with pytest.raises(TransferError, match="the prefill is shutting down") as info:
            await wait
        assert info.value.stage == "handshake"


async def test_stop_waiting_ends_the_decodes_exchanges_and_refuses_new_ones(pair: Pair) -> None:
    exchanging = asyncio.create_task(pair.exchange(77, transfer_timeout=600))
    await pair.any_connected.wait()
    pair.decode.stop_waiting()
    with pytest.raises(TransferError, match="the decode is shutting down") as info:
        await exchanging
    assert info.value.stage == "transfer"
    with pytest.raises(TransferError, match="the decode is shutting down"):
        await pair.exchange(78)


class _ReadyNotSent(PushPool):
    """Sends everything but KV-ready messages, which time out as on a stuck socket."""

    async def send(self, ip: str, port: int, frames: list[bytes]) -> None:
        if frames[1] == b"success":
            raise TimeoutError("send timed out")
        await super().send(ip, port, frames)


async def test_a_kv_ready_that_cannot_be_sent_fails_the_prefill_and_tells_the_decode(
    context: zmq.asyncio.Context,
) -> None:
    """Before, the prefill answered as if the decode had its KV, and the decode waited for
    a KV-ready message that was never sent until its transfer timeout."""
    pair = Pair(context)
    metrics = EngineMetrics(CollectorRegistry())
    pair.prefill = PrefillTransfer(
        context,
        metrics,
        RANKS,
        bind_host="127.0.0.1",
        advertise_host="127.0.0.1",
        pool=_ReadyNotSent(context, timeout=5.0),
    )
    await pair.prefill.start()
    await pair.decode.start()
    try:
        decode = asyncio.create_task(pair.exchange(77, transfer_timeout=60))
        with pytest.raises(TransferError, match="KV-ready for bootstrap_room 77 not sent") as sent:
            await serve_room(pair, 77)
        assert sent.value.stage == "transfer"
        with pytest.raises(TransferError, match="not sent") as told:
            await asyncio.wait_for(decode, 10)
        assert told.value.stage == "transfer"
    finally:
        await pair.decode.stop()
        await pair.prefill.stop()
