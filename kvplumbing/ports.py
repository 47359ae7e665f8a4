"""Ports chosen for a process that binds them itself (a child, a server started later).

A port taken with `bind(0)` and released comes from the kernel's ephemeral range, the
range every outgoing connection's source port is drawn from as well: between the release
and the child's own bind, any `connect()` on the machine (a test's client, a health
check, a Redis connection) may take it, and the child fails with "address already in
use". Ports below that range are never handed out by the kernel on its own, so only a
process that names the same number can collide; each one given is checked free first.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10_000
"""Below this lie the ports services are commonly configured on."""
_DEFAULT_EPHEMERAL_LOW = 32_768


def _ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _DEFAULT_EPHEMERAL_LOW


def _bindable(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _kernel_ports(count: int, host: str) -> list[int]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    socks = [socket.socket(family, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in socks:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def unclaimed_ports(
    count: int, host: str = "127.0.0.1", rng: random.Random | None = None
) -> list[int]:
    """`count` distinct ports, free on `host` now and outside the kernel's ephemeral range.

    Where that range leaves too little room below it, the kernel's own choice (`bind(0)`).
    """
    draw = rng or random.Random()
    low = _ephemeral_low()
    if low - LOWEST < 16 * count:
        return _kernel_ports(count, host)
    ports: list[int] = []
    for _ in range(64 * count):
        port = draw.randrange(LOWEST, low)
        if port not in ports and _bindable(host, port):
            ports.append(port)
            if len(ports) == count:
                return ports
    return ports + _kernel_ports(count - len(ports), host)
