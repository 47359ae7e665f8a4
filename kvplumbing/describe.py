"""A failed exchange in words, the same way everywhere: for logs, errors and reports.

httpx's messages are often empty (a timeout says nothing), so the exception's type is
always named; an answer is its status and its text.
"""

from __future__ import annotations

import httpx


def describe_error(exc: BaseException) -> str:
    """`Type: message`, or the type alone when the message is empty."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def describe_answer(response: httpx.Response) -> str:
    return f"HTTP {response.status_code}: {response.text.strip()}"
