"""Bearer checks (any header a client can send is a yes or a no, never an error) and
protected mode (who may change state)."""

from __future__ import annotations

import pytest

from kvplumbing.auth import (
    PUBLISHED_DEFAULT_TOKEN,
    ProtectedMode,
    ProtectionFlags,
    bearer_matches,
    is_loopback,
)


@pytest.mark.parametrize(
    ("header", "secret", "expected"),
    [
        ("Bearer s3cret", "s3cret", True),
        ("bearer s3cret ", "s3cret", True),
        ("Bearer wrong", "s3cret", False),
        ("Basic s3cret", "s3cret", False),
        (None, "s3cret", False),
        ("Bearer café", "s3cret", False),
        ("Bearer ☃", "s3cret", False),
        # A UTF-8 secret arrives as its bytes decoded as latin-1, as servers decode headers.
        ("Bearer " + "clé".encode().decode("latin-1"), "clé", True),
        ("Bearer anything", None, True),
    ],
)
def test_bearer_matches(header: str | None, secret: str | None, expected: bool) -> None:
    assert bearer_matches(header, secret) is expected


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("10.213.0.2", False),
        ("0.0.0.0", False),
        ("::ffff:10.0.0.1", False),
        ("fe80::1%eth0", False),
        ("localhost", False),  # a peer address is never a name
        ("testclient", False),
        ("", False),
        (None, False),
    ],
)
def test_is_loopback(host: str | None, expected: bool) -> None:
    assert is_loopback(host) is expected


def _mode(token: str | None = None, *, insecure: bool = False) -> ProtectedMode:
    return ProtectedMode("the indexer", token, insecure, ProtectionFlags("indexer"))


def test_without_a_token_only_loopback_clients_may_change_state() -> None:
    mode = _mode()
    assert mode.check("POST", "/v1/pods", None, "127.0.0.1") is None
    assert mode.check("POST", "/v1/pods", None, "::1") is None
    refusal = mode.check("POST", "/v1/pods", None, "10.213.0.2")
    assert refusal is not None
    assert refusal.status == 403
    for words in (
        "POST /v1/pods",
        "10.213.0.2",
        "protected mode",
        "`--admin-token` (GLOBALKV_INDEXER_ADMIN_TOKEN)",
        "`--insecure` (GLOBALKV_INDEXER_INSECURE)",
        "Authorization: Bearer",
    ):
        assert words in refusal.message
    unknown = mode.check("POST", "/v1/pods", None, None)
    assert unknown is not None
    assert unknown.status == 403


def test_insecure_opens_changes_to_every_host() -> None:
    assert _mode(insecure=True).check("DELETE", "/v1/pods/p", None, "10.0.0.9") is None


@pytest.mark.parametrize("client", ["127.0.0.1", "10.213.0.2"])
@pytest.mark.parametrize("insecure", [False, True])
def test_a_token_is_required_from_every_host(client: str, insecure: bool) -> None:
    mode = _mode("s3cret", insecure=insecure)
    assert mode.check("POST", "/v1/pods", "Bearer s3cret", client) is None
    refusal = mode.check("POST", "/v1/pods", "Bearer nope", client)
    assert refusal is not None
    assert refusal.status == 401
    assert "`--admin-token` (GLOBALKV_INDEXER_ADMIN_TOKEN)" in refusal.message
    assert "s3cret" not in refusal.message
    assert "s3cret" not in repr(mode)


def test_flags_of_an_embedding_command_are_named() -> None:
    flags = ProtectionFlags("engine", "--bootstrap-admin-token", "--bootstrap-insecure")
    mode = ProtectedMode("the engine's bootstrap directory", None, False, flags)
    refusal = mode.check("DELETE", "/v1/directory", None, "10.0.0.1")
    assert refusal is not None
    assert "GLOBALKV_ENGINE_BOOTSTRAP_ADMIN_TOKEN" in refusal.message
    assert "GLOBALKV_ENGINE_BOOTSTRAP_INSECURE" in refusal.message


def test_warnings_name_open_doors() -> None:
    assert _mode().warnings() == []
    assert _mode("s3cret").warnings() == []
    (published,) = _mode(PUBLISHED_DEFAULT_TOKEN).warnings()
    assert "docker-compose.yml's default" in published
    assert "GLOBALKV_ADMIN_TOKEN" in published
    (open_door,) = _mode(insecure=True).warnings()
    assert "any host" in open_door
    (no_effect,) = _mode("s3cret", insecure=True).warnings()
    assert "no effect" in no_effect
