from __future__ import annotations

import asyncio
import time

import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from enginesim.config import FaultSettings
from enginesim.faults import Faults
from enginesim.kvcache import CacheNamespace, PagedKVCache
from enginesim.metrics import EngineMetrics
from enginesim.publisher import (
    KVEventPublisher,
    PublisherSettings,
    endpoint_binds,
    wire_events,
)
from globalkv.wire import (
    FLAVORS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    Flavor,
    decode_batch,
    pack_seq,
    parse_live,
    parse_replay_reply,
    replay_request,
)

TOPIC = "kv@pod-a@model"
PROBE = BlockRemoved(block_hashes=[0xFEEDFACE], medium="GPU")
"""What `_until_subscribed` publishes; a probe still in flight after it returns is skipped."""


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


class Harness:
    """A publisher on free ports with a SUB that is known to receive."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        registry: CollectorRegistry,
        flavor: Flavor = "sglang",
        drop_seqs: frozenset[int] = frozenset(),
    ) -> None:
        self.context = context
        self.registry = registry
        self.drop_seqs = drop_seqs
        self.dropping = False
        self.publisher = KVEventPublisher(
            PublisherSettings(
                endpoint="tcp://*:0",
                replay_endpoint="tcp://127.0.0.1:0",
                topic=TOPIC,
                flavor=flavor,
                dp_rank=1,
                buffer_steps=4,
            ),
            context,
            EngineMetrics(registry),
            drop=lambda: self.dropping and self.publisher.next_seq - 1 in self.drop_seqs,
            clock=lambda: 12.5,
        )
        self.sub = context.socket(zmq.SUB)

    async def start(self) -> None:
        await self.publisher.start()
        assert self.publisher.bound_endpoint is not None
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        self.sub.connect(self.publisher.bound_endpoint.replace("0.0.0.0", "127.0.0.1"))
        await self._until_subscribed()

    async def _until_subscribed(self) -> None:
        """A PUB drops everything until the SUB's subscription reaches it (slow joiner):
        publish probes until one arrives, then start the test from a clean seq."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            self.publisher.publish([PROBE])
            await self.publisher.drain()
            if await self.sub.poll(100):
                while await self.sub.poll(50):
                    await self.sub.recv_multipart()
                self.publisher.restart()
                self.dropping = True
                return
        raise TimeoutError("SUB never received a probe")

    async def receive(self) -> tuple[int, list[Event]]:
        while True:
            frame = parse_live(await asyncio.wait_for(self.sub.recv_multipart(), 10))
            assert frame.topic == TOPIC.encode()
            batch = decode_batch(frame.payload)
            assert (batch.dp_rank, batch.ts) == (1, 12.5)
            if list(batch.events) != [PROBE]:
                return frame.seq, list(batch.events)

    async def replay(self, start: int, request: list[bytes] | None = None) -> list[list[bytes]]:
        assert self.publisher.bound_replay_endpoint is not None
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.publisher.bound_replay_endpoint)
        await dealer.send_multipart(request or replay_request(start))
        replies: list[list[bytes]] = []
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), 10)
            replies.append(frames)
            if parse_replay_reply(frames) is None:
                break
        dealer.close()
        return replies

    async def stop(self) -> None:
        self.sub.close()
        await self.publisher.stop()


@pytest.mark.parametrize("flavor", FLAVORS)
async def test_cache_changes_decode_back_for_every_flavor(
    context: zmq.asyncio.Context, registry: CollectorRegistry, flavor: Flavor
) -> None:
    harness = Harness(context, registry, flavor)
    await harness.start()
    cache = PagedKVCache(page_size=2, capacity=2)
    for changes in (cache.insert([1, 2, 3, 4]), cache.insert([5, 6]), cache.reset()):
        harness.publisher.publish(wire_events(changes, 2, "sglang"))
    await harness.publisher.drain()

    seq, [stored] = await harness.receive()
    assert seq == 0
    assert isinstance(stored, BlockStored)
    assert stored.parent_block_hash is None
    assert (list(stored.token_ids), stored.block_size, stored.medium) == ([1, 2, 3, 4], 2, "GPU")
    seq, (removed, new) = await harness.receive()
    assert seq == 1
    assert isinstance(removed, BlockRemoved)
    assert list(removed.block_hashes) == [stored.block_hashes[1]]
    assert isinstance(new, BlockStored)
    assert list(new.token_ids) == [5, 6]
    assert await harness.receive() == (2, [AllBlocksCleared()])
    await harness.stop()


async def test_dropped_batches_skip_the_live_stream_and_replay_returns_them(
    context: zmq.asyncio.Context, registry: CollectorRegistry
) -> None:
    harness = Harness(context, registry, drop_seqs=frozenset({1, 2}))
    await harness.start()
    for page in range(4):
        harness.publisher.publish(wire_events(PagedKVCache(1, 8).insert([page]), 1, "sglang"))
    await harness.publisher.drain()
    assert (await harness.receive())[0] == 0
    assert (await harness.receive())[0] == 3

    replies = await harness.replay(1)
    frames = [parse_replay_reply(reply) for reply in replies]
    assert [f.seq for f in frames if f is not None] == [1, 2, 3]
    assert frames[-1] is None
    assert all(len(reply) == 4 and reply[1] == TOPIC.encode() for reply in replies[:-1])
    dropped = registry.get_sample_value(
        "globalkv_engine_kv_event_batches_total", {"dp_rank": "1", "outcome": "dropped_fault"}
    )
    assert dropped == 2
    await harness.stop()


async def test_replay_buffer_is_bounded_and_restart_resets_seq(
    context: zmq.asyncio.Context, registry: CollectorRegistry
) -> None:
    harness = Harness(context, registry, flavor="vllm-array")
    await harness.start()
    for _ in range(6):
        harness.publisher.publish([AllBlocksCleared()])
    await harness.publisher.drain()
    replies = await harness.replay(0)
    assert [len(reply) for reply in replies] == [3] * 5
    assert [f.seq for r in replies if (f := parse_replay_reply(r)) is not None] == [2, 3, 4, 5]

    harness.publisher.restart()
    assert harness.publisher.publish([AllBlocksCleared()]) == 0
    await harness.publisher.drain()
    assert [f.seq for r in await harness.replay(0) if (f := parse_replay_reply(r)) is not None] == [
        0
    ]
    await harness.stop()


async def test_malformed_replay_request_is_counted_and_the_router_keeps_serving(
    context: zmq.asyncio.Context, registry: CollectorRegistry
) -> None:
    harness = Harness(context, registry)
    await harness.start()
    harness.publisher.publish([AllBlocksCleared()])
    await harness.publisher.drain()
    assert harness.publisher.bound_replay_endpoint is not None
    bad = context.socket(zmq.DEALER)
    bad.setsockopt(zmq.LINGER, 0)
    bad.connect(harness.publisher.bound_replay_endpoint)
    await bad.send_multipart([b"", b"\x01\x02"])
    await bad.send_multipart([b"garbage"])
    replies = await harness.replay(0, [b"", pack_seq(0)])
    assert len(replies) == 2
    malformed = registry.get_sample_value(
        "globalkv_engine_kv_replay_requests_total", {"dp_rank": "1", "outcome": "malformed"}
    )
    assert malformed == 2
    bad.close()
    await harness.stop()


def test_a_batch_dropped_by_fault_injection_is_counted_once_as_a_fault(
    context: zmq.asyncio.Context, registry: CollectorRegistry
) -> None:
    metrics = EngineMetrics(registry)
    faults = Faults(FaultSettings(drop_event_rate=1.0), metrics)
    settings = PublisherSettings("tcp://*:0", None, TOPIC, "sglang", dp_rank=0)
    publisher = KVEventPublisher(settings, context, metrics, drop=faults.drop_event_batch)
    assert publisher.publish([AllBlocksCleared()]) == 0
    sample = registry.get_sample_value
    assert sample("globalkv_engine_faults_injected_total", {"kind": "drop_event"}) == 1
    dropped = {"dp_rank": "0", "outcome": "dropped_fault"}
    assert sample("globalkv_engine_kv_event_batches_total", dropped) == 1


def test_empty_batches_are_not_published(
    context: zmq.asyncio.Context, registry: CollectorRegistry
) -> None:
    publisher = Harness(context, registry).publisher
    assert publisher.publish([]) is None
    assert publisher.next_seq == 0


@pytest.mark.parametrize(
    ("endpoint", "binds"),
    [
        ("tcp://*:5557", True),
        ("tcp://0.0.0.0:5557", True),
        ("tcp://[::]:5557", True),
        ("ipc:///tmp/kv", True),
        ("inproc://kv", True),
        ("tcp://10.0.0.5:5557", False),
        ("tcp://indexer:5557", False),
    ],
)
def test_bind_or_connect_follows_the_peers_rule(endpoint: str, binds: bool) -> None:
    assert endpoint_binds(endpoint) is binds


async def test_a_taken_port_fails_start_with_the_bind_error(
    context: zmq.asyncio.Context, registry: CollectorRegistry
) -> None:
    first = Harness(context, registry).publisher
    await first.start()
    assert first.bound_endpoint is not None
    settings = PublisherSettings(
        endpoint="tcp://*:0",
        replay_endpoint=first.bound_endpoint.replace("0.0.0.0", "127.0.0.1"),
        topic=TOPIC,
        flavor="sglang",
        dp_rank=0,
    )
    second = KVEventPublisher(settings, context, EngineMetrics(CollectorRegistry()))
    with pytest.raises(zmq.ZMQError, match="in use"):
        await second.start()
    assert second.bound_replay_endpoint is None
    await second.stop()
    await first.stop()


def test_namespaced_stores_are_named_as_each_engine_names_them() -> None:
    """vLLM 0.33: the LoRA name on every block's extra keys, the salt on the chain's first
    block only; SGLang 0.5.23: `lora_name` and `cache_salt` on the event."""
    cache = PagedKVCache(2, 8)
    tenant = CacheNamespace(lora_name="ad", lora_id=1, cache_salt="t")
    first = cache.insert([1, 2, 3, 4], tenant)
    later = cache.insert([1, 2, 3, 4, 5, 6], tenant)
    vllm = [e for e in wire_events([*first, *later], 2, "vllm") if isinstance(e, BlockStored)]
    assert [(e.lora_name, e.lora_id, e.extra_keys) for e in vllm] == [
        ("ad", 1, [["ad", "t"], ["ad"]]),
        ("ad", 1, [["ad"]]),
    ]
    (sglang,) = wire_events(first, 2, "sglang")
    assert isinstance(sglang, BlockStored)
    assert (sglang.lora_name, sglang.cache_salt, sglang.extra_keys) == ("ad", "t", None)
    (base,) = wire_events(PagedKVCache(2, 8).insert([1, 2]), 2, "vllm")
    assert isinstance(base, BlockStored)
    assert base.extra_keys == [None]
