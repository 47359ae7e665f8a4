from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.bootstrap.served import Directory, open_directory


@pytest.fixture
async def directory() -> AsyncIterator[Directory]:
    """A fresh directory app with a fake clock and its own metrics registry."""
    env, client = await open_directory()
    async with client:
        yield env
