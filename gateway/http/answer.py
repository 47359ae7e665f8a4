"""The gateway's own complete answers: a worker's whole answer passed on, or a refusal.

One home for the type every front and the dispatcher share, and for the error body
sglang-router's clients expect (`{"error": {"message", "type"}}`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(slots=True)
class Answer:
    """A complete answer, from a worker or the gateway itself."""

    status: int
    body: bytes
    media_type: bytes = b"application/json"


def error_body(message: str, kind: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind}}).encode()


def problem(status: int, message: str, kind: str = "invalid_request_error") -> Answer:
    return Answer(status, error_body(message, kind))


def too_large(limit: int) -> Answer:
    return problem(413, f"request body exceeds --max-payload-size ({limit} bytes)")
