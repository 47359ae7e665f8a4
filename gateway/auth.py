"""Bearer-token checks shared by the inference and admin endpoints."""

from __future__ import annotations

import hmac

from starlette.requests import Request


def bearer_ok(request: Request, secret: str | None) -> bool:
    """True when no secret is configured or the request carries it as a Bearer token."""
    if secret is None:
        return True
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip(), secret)
