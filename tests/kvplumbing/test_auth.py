"""Bearer checks: any header a client can send is a yes or a no, never an error."""

from __future__ import annotations

import pytest

from kvplumbing.auth import bearer_matches


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
