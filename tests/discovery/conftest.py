from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.support.kube_api import FakeKubeApi


@pytest.fixture
async def api() -> AsyncIterator[FakeKubeApi]:
    """A Kubernetes API stand-in, listening (tests/support/kube_api.py)."""
    server = FakeKubeApi()
    await server.start()
    yield server
    await server.stop()
