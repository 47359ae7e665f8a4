from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import zmq.asyncio
from prometheus_client import CollectorRegistry

from globalkv.ingest.config import IngestConfig
from globalkv.ingest.service import IngestService
from globalkv.metrics import IngestMetrics
from globalkv.registry import MemoryRegistry, Registry
from tests.ingest.fakes import RecordingIndex
from tests.ingest.publisher import Publisher


@pytest.fixture
def index() -> RecordingIndex:
    return RecordingIndex()


@pytest.fixture
def prom() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def registry() -> MemoryRegistry:
    return MemoryRegistry()


ServiceFactory = Callable[..., IngestService]


@pytest.fixture
async def make_service(
    context: zmq.asyncio.Context,
    index: RecordingIndex,
    registry: MemoryRegistry,
    prom: CollectorRegistry,
) -> AsyncIterator[ServiceFactory]:
    services: list[IngestService] = []

    def make(own_registry: Registry | None = None, **config: object) -> IngestService:
        """`own_registry`: one the test made, instead of the fixture's."""
        settings = {
            "replay_reply_timeout": 0.3,
            "retry_base": 0.005,
            "retry_cap": 0.02,
            "max_group": 1,
            **config,
        }
        service = IngestService(
            index,
            registry if own_registry is None else own_registry,
            IngestMetrics(prom),
            IngestConfig.model_validate(settings),
            context=context,
        )
        services.append(service)
        return service

    yield make
    for service in services:
        await service.stop()


PublisherFactory = Callable[..., Awaitable[Publisher]]


@pytest.fixture
async def make_publisher(context: zmq.asyncio.Context) -> AsyncIterator[PublisherFactory]:
    publishers: list[Publisher] = []

    async def make(**kw: object) -> Publisher:
        kw.setdefault("endpoint", "tcp://127.0.0.1:0")
        kw.setdefault("replay_endpoint", "tcp://127.0.0.1:0")
        publisher = Publisher(context, **kw)  # type: ignore[arg-type]
        await publisher.start()
        publishers.append(publisher)
        return publisher

    yield make
    for publisher in publishers:
        await publisher.stop()
