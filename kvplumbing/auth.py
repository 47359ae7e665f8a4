"""Bearer-token checks: any header a client can send is a yes or a no, never an error.

The scheme is matched case-insensitively and the token stripped (RFC 9110 makes the
scheme case-insensitive; clients and proxies differ in both), and the token is compared in
constant time, so the answer's timing tells nothing about the secret.
"""

from __future__ import annotations

import hmac

from starlette.requests import Request


def bearer_matches(authorization: str | None, secret: str | None) -> bool:
    """True when no secret is configured or `authorization` is `Bearer <secret>`."""
    if secret is None:
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        _octets(token.strip()), secret.encode("utf-8")
    )


def _octets(header_value: str) -> bytes:
    """The header's bytes: servers decode them as latin-1, so a UTF-8 secret still matches.

    Compared as bytes because `compare_digest` refuses str with non-ASCII characters
    (a TypeError, which would be a 500 for any such header).
    """
    try:
        return header_value.encode("latin-1")
    except UnicodeEncodeError:
        return header_value.encode("utf-8")


def bearer_ok(request: Request, secret: str | None) -> bool:
    """`bearer_matches` for the request's `Authorization` header."""
    return bearer_matches(request.headers.get("authorization"), secret)
