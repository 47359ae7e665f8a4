"""Bearer-token checks shared by the inference and admin endpoints."""

from __future__ import annotations

import hmac

from starlette.requests import Request


def bearer_matches(authorization: str | None, secret: str | None) -> bool:
    """True when no secret is configured or `authorization` is `Bearer <secret>`."""
    if secret is None:
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip(), secret)


def bearer_ok(request: Request, secret: str | None) -> bool:
    return bearer_matches(request.headers.get("authorization"), secret)
