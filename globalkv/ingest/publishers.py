"""Who may publish on the bound socket, and where each pod's events may come from.

A bound SUB takes messages from whoever connects, and a message names its pod only by
its topic, so without a rule anyone who reaches the port speaks for every pod: one
`[kv@<pod>@<model>, 0, …]` wipes a pod ("engine restarted"), a forged BlockStored claims
a prefix it never computed. Engines cannot be changed: vLLM and SGLang publish with a
plain ZMQ PUB, no credentials (neither sets any CURVE option), so the rule is by address,
as protected mode's (`kvplumbing.auth`):

- ZMQ asks this module's ZAP handler about every connection to the bound SUB (its
  `ZAP_DOMAIN`); only loopback peers and the networks the operator allowed
  (`--allow-publisher CIDR`) complete the handshake. Another host's messages never
  arrive: its connection is refused and counted (`globalkv_ingest_refused_publishers`).
- Each message carries its sender's address (ZMQ's `Peer-Address`). A pod whose
  registration names where it lives (the host of its `url`, `kv_events.replay_endpoint`
  or `bootstrap_host`) accepts messages only from those addresses; one that names none (a
  pod discovered on the socket) is tied to the address of its first accepted message.
  A message for a pod from anywhere else is dropped as `wrong_publisher`.

A message over ipc:// carries no address: it came from this machine, like loopback.

The ZAP handler is ours rather than pyzmq's `zmq.auth` authenticator, which allows single
addresses, not networks: an operator names the engines' subnets (`10.0.0.0/16`), not every
pod IP a scheduler may hand out.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Iterable, Sequence
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

from globalkv.metrics import IngestMetrics
from globalkv.registry import PodInfo

log = logging.getLogger(__name__)

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
"""Where libzmq asks (RFC 27); one handler per context."""
ZAP_DOMAIN = "globalkv-kv-events"
"""Set on the bound SUB: with the NULL mechanism libzmq asks the handler only then."""
LOOPBACK: tuple[Network, ...] = (
    ipaddress.ip_network("127.0.0.0/8"),
    ipaddress.ip_network("::1/128"),
)
ALLOW_PUBLISHER_FLAG = "--allow-publisher"
RESOLVE_TIMEOUT = 5.0
"""Longest wait for a pod's host names to resolve when it is followed."""
MAX_LOGGED = 1024
"""Refused addresses logged once each (a bounded set: anyone can connect)."""


def address_of(text: str | None) -> Address | None:
    """The address ZMQ reported (an IPv4-mapped IPv6 address as IPv4); None when there is
    none (ipc://, inproc://) or it does not parse."""
    if not text:
        return None
    try:
        address = ipaddress.ip_address(text.partition("%")[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def pod_hosts(info: PodInfo) -> list[str]:
    """The hosts a pod's registration says it lives on (none for a discovered pod)."""
    hosts: list[str] = []
    if info.url:
        host = urlsplit(info.url).hostname
        if host:
            hosts.append(host)
    replay = info.kv_events.replay_endpoint
    if replay is not None and replay.startswith("tcp://"):
        hosts.append(replay.removeprefix("tcp://").rpartition(":")[0].strip("[]"))
    if info.bootstrap_host:
        hosts.append(info.bootstrap_host)
    return hosts


async def resolve(hosts: Iterable[str]) -> frozenset[Address]:
    """Every address of `hosts`; a name that does not resolve adds none (logged)."""
    found: set[Address] = set()
    loop = asyncio.get_running_loop()
    for host in hosts:
        literal = address_of(host)
        if literal is not None:
            found.add(literal)
            continue
        try:
            async with asyncio.timeout(RESOLVE_TIMEOUT):
                infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except (OSError, TimeoutError) as exc:
            log.warning(
                "host %s of a bound pod does not resolve (%s): no message from it is taken "
                "for the pod",
                host,
                exc,
            )
            continue
        found.update(a for info in infos if (a := address_of(str(info[4][0]))) is not None)
    return frozenset(found)


class Publishers:
    """The allow-list (loopback and the operator's networks) and the ZAP handler."""

    def __init__(self, allowed: Sequence[Network], metrics: IngestMetrics) -> None:
        self.networks: tuple[Network, ...] = (*LOOPBACK, *allowed)
        self._metrics = metrics
        self._logged: set[str] = set()
        self._socket: zmq.asyncio.Socket | None = None

    def allows(self, peer: str) -> bool:
        """May a publisher at `peer` (ZMQ's address text, empty for ipc://) connect?"""
        address = address_of(peer)
        if address is None:
            return not peer  # ipc/inproc: this machine; an address that does not parse: no
        return any(address in network for network in self.networks)

    def listen(self, context: zmq.asyncio.Context) -> None:
        """Take ZMQ's authentication requests in `context`: before the SUB binds, or its
        first connections would be let through unasked."""
        sock = context.socket(zmq.REP)
        sock.linger = 0
        sock.bind(ZAP_ENDPOINT)
        self._socket = sock

    async def serve(self) -> None:
        """Answer every request (RFC 27): 200 for an allowed peer, 400 otherwise."""
        sock = self._socket
        assert sock is not None, "listen() first"
        try:
            while True:
                request = await sock.recv_multipart()
                await sock.send_multipart(self.answer(request))
        finally:
            sock.close(linger=0)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)

    def answer(self, request: list[bytes]) -> list[bytes]:
        if len(request) < 6:
            return [b"1.0", b"", b"500", b"malformed ZAP request", b"", b""]
        version, request_id, domain, peer = request[:4]
        text = peer.decode("ascii", "replace")
        if domain != ZAP_DOMAIN.encode() or not self.allows(text):
            self._refused(text)
            return [version, request_id, b"400", b"publisher not allowed", b"", b""]
        return [version, request_id, b"200", b"OK", b"", b""]

    def _refused(self, peer: str) -> None:
        self._metrics.refused_publishers.inc()
        if peer in self._logged or len(self._logged) >= MAX_LOGGED:
            return
        self._logged.add(peer)
        log.warning(
            "refused a KV-event publisher at %s on the bound socket: only loopback and the "
            "networks of %s are allowed",
            peer or "an unknown address",
            ALLOW_PUBLISHER_FLAG,
        )
