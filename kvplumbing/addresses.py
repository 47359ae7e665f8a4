"""What counts as a host, and as an HTTP URL, where a peer or an operator names one.

A pod's KV-event endpoint and a prefill rank's `rank_ip` are written by a peer and later
dialled by another process; a string that is not a host (a URL, a NUL byte,
`999.999.999.999`) would only fail there, far from the request that stored it. The rule is
the strict one, not what a resolver happens to accept: an IPv4 dotted quad, an IPv6
address without a zone, or a DNS name of RFC 1123 labels. A name whose last label is
numeric must be an IPv4 address, so `999.1.1.1` is not taken for a name. An HTTP URL
given on a command line or in a configuration is checked as it is read, so a placeholder
left in it (`http://127.0.0.1:INDEX_PORT`) is one line of error, not a traceback. A URL
shown to an operator (`--check`, an error) has its password hidden: it lands in logs.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?", re.ASCII)

HOST_RULE = (
    "a DNS name (letters, digits, inner '-', dot-separated), an IPv4 address or an IPv6 address"
)
"""The rule in words, for error messages."""


def is_ipv6(host: str) -> bool:
    """An IPv6 address without a %zone (bare, as a rank registers it)."""
    with contextlib.suppress(ValueError):
        return ipaddress.IPv6Address(host).scope_id is None
    return False


def is_host(host: str) -> bool:
    """A name or IPv4 address (`is_ipv6` for the other family)."""
    labels = host.removesuffix(".").split(".")
    if labels[-1].isdigit():
        with contextlib.suppress(ValueError):
            ipaddress.IPv4Address(host)
            return True
        return False
    return len(host) <= 253 and all(_LABEL.fullmatch(label) for label in labels)


def check_http_url(url: str) -> str:
    """`url` without its trailing slash, or ValueError saying what is wrong. It is written
    into request lines as it is, so whitespace and control characters are refused
    (urlsplit would drop CR/LF silently)."""
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        raise ValueError(f"{url!r} contains whitespace or control characters")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s) URL with a host")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{url!r} has an invalid port (a number 1-65535)") from None
    if port == 0:
        raise ValueError(f"{url!r} has an invalid port (a number 1-65535)")
    return url.rstrip("/")


_HIDDEN = "***"


def redacted(url: str) -> str:
    """`url` with the password of its credentials, and a `password` query value, as ***."""
    parts = urlsplit(url)
    credentials, at, hosts = parts.netloc.rpartition("@")
    netloc = parts.netloc
    if at:
        user, colon, _ = credentials.partition(":")
        netloc = f"{user}:{_HIDDEN}@{hosts}" if colon else f"{_HIDDEN}@{hosts}"
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    if not any(key.lower() == "password" for key, _ in pairs):
        return urlunsplit(parts._replace(netloc=netloc))
    hidden = [(key, _HIDDEN if key.lower() == "password" else value) for key, value in pairs]
    return urlunsplit(parts._replace(netloc=netloc, query=urlencode(hidden, safe="*")))
