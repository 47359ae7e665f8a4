"""The request headers every entry point reads alike: the conversation a client names and
the prefill an endpoint picker names for a decode's sidecar.

Sessions: smg's `X-SMG-Routing-Key`, then Dynamo's `X-Dynamo-Session-ID`, kept on their
prefill by the prefix policy (`gateway.policies.sessions`); at most `MAX_SESSION_BYTES`.

The named prefill: globalkv's `x-globalkv-prefill`, then llm-d's `x-prefiller-host-port`,
as `host:port`. The picker sets both (so either project's sidecar serves behind either
picker); a sidecar binds the request to it. Only the picker may name one: the data plane
removes both from every client's request (`globalkv.stack.envoy`).

Headers are read from the ones a reader picked (`Picked`: names in lowercase, a repeated
header by its last value), so each request's headers are walked once.
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.requests.bodies import BadRequest

Picked = Mapping[bytes, bytes]
"""The request headers a reader asked for, by name in lowercase."""

SESSION_HEADERS = (b"x-smg-routing-key", b"x-dynamo-session-id")
MAX_SESSION_BYTES = 256
PREFILL_HEADER = "x-globalkv-prefill"
"""globalkv's header naming the prefill (`host:port`) the sidecar binds the request to."""
LLMD_PREFILL_HEADER = "x-prefiller-host-port"
"""llm-d's header for the same."""
PREFILL_HEADERS = (PREFILL_HEADER.encode(), LLMD_PREFILL_HEADER.encode())


def session(picked: Picked) -> str | None:
    """The conversation the client named, by the first of `SESSION_HEADERS` it sent;
    `BadRequest` for one too long."""
    for name in SESSION_HEADERS:
        value = picked.get(name)
        if not value:
            continue
        if len(value) > MAX_SESSION_BYTES:
            raise BadRequest(f"{name.decode()} is longer than {MAX_SESSION_BYTES} bytes")
        return value.decode("latin-1")
    return None


def named_prefill(picked: Picked) -> str | None:
    """The prefill's worker id (`host:port`) the headers name, ours first; `BadRequest`
    when the header is not `host:port`."""
    for name in PREFILL_HEADERS:
        value = picked.get(name)
        if value is not None:
            return _host_port(name.decode(), value.decode("latin-1").strip())
    return None


def _host_port(name: str, value: str) -> str:
    host, sep, port = value.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if (
        not sep
        or not host
        or not port.isdigit()
        or not 0 < int(port) < 65536
        or (":" in host and not bracketed)
        or any(c in host for c in "/@?# ")
    ):
        raise BadRequest(f"{name} must be host:port, got {value[:100]!r}")
    return f"{host}:{int(port)}"
