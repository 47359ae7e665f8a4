"""How the clients put a failed HTTP exchange into words, the same way everywhere."""

from __future__ import annotations

import httpx


def describe_error(exc: httpx.HTTPError) -> str:
    """The exception type always: httpx's messages are often empty (timeouts)."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def describe_answer(response: httpx.Response) -> str:
    return f"HTTP {response.status_code}: {response.text.strip()}"
