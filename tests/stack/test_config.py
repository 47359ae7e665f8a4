"""The local cluster's configuration: what it refuses as a whole."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from globalkv.stack.config import StackConfig


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "::", "localhost", "127.0.0.2"])
def test_a_loopback_or_wildcard_host_needs_no_token(host: str) -> None:
    assert StackConfig(host=host).admin_token is None


def test_a_host_address_of_its_own_needs_a_token_or_insecure() -> None:
    with pytest.raises(ValidationError, match="--admin-token") as refused:
        StackConfig(host="10.213.0.1")
    assert "GLOBALKV_UP_ADMIN_TOKEN" in str(refused.value)
    assert StackConfig(host="10.213.0.1", admin_token="t").token == "t"
    assert StackConfig(host="10.213.0.1", insecure=True).insecure


@pytest.mark.parametrize(
    "settings",
    [
        {"prefill": 0},
        {"decode": 33},
        {"redis_url": "http://127.0.0.1:6379"},
        {"gateway_port": 70000},
        {"block_size": 0},
        {"unknown": 1},
    ],
)
def test_invalid_settings_are_refused(settings: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        StackConfig.model_validate(settings)
