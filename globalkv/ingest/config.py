"""How ingest runs: one typed object, its defaults and why, read from flags only by the CLI."""

from __future__ import annotations

from ipaddress import IPv4Network, IPv6Network
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from globalkv.registry import PodInfo
from kvplumbing.environment import env_var_name

EndpointScheme = Literal["ipc", "inproc"]
"""Schemes besides tcp:// that a pod's KV-event endpoints may have when the operator allows."""
ALLOW_SCHEME_FLAG = "--allow-endpoint-scheme"


class EndpointRefused(ValueError):
    """A pod whose KV-event endpoint has a scheme this indexer does not connect to."""


class IngestConfig(BaseModel):
    bind: list[str] = Field(
        default_factory=list,
        description="Endpoints to bind one SUB on, for engines that connect to the indexer.",
    )
    allow_publishers: list[IPv4Network | IPv6Network] = Field(
        default_factory=list,
        description="Networks besides loopback whose engines may publish to the bound SUB. "
        "Anyone who reaches it could otherwise speak for any pod (wipe its blocks, claim "
        "prefixes it never computed); engines publish without credentials, so the rule is "
        "the peer's address, checked by ZMQ's ZAP handler as each connection opens.",
    )
    queue_size: int = Field(
        1024,
        ge=1,
        description="Batches queued per source before "
        "back-pressure (connected engines) or drops (bound socket).",
    )
    max_queued_events: int = Field(
        1 << 16,
        ge=1,
        description="Decoded events queued per source (a batch alone may pass it): what "
        "bounds memory and garbage-collection pauses when batches arrive faster than the "
        "index takes them, since a decoded event costs several times its bytes on the wire. "
        "Past it, back-pressure (connected engines) or drops (bound socket).",
    )
    max_group: int = Field(
        64,
        ge=1,
        description="Most consecutive queued batches of one source applied as one index "
        "write (group commit under load).",
    )
    rcvhwm: int = Field(
        10_000,
        ge=1,
        description="ZMQ receive high-water mark per SUB, in batches: with the queue, the "
        "bound on memory per source while the index is slow (the engine's PUB drops beyond).",
    )
    max_message_bytes: int = Field(
        64 << 20,
        ge=1024,
        description="Largest KV-event message accepted, live or replayed: anyone who can "
        "reach a bound SUB can send one. A larger one closes the sender's connection.",
    )
    max_discovered_pods: int = Field(
        4096,
        ge=0,
        description="Most pods followed at once because they appeared on the bound socket "
        "(each costs a worker and a registry entry, and anyone who reaches the socket can "
        "name one); a new topic past it is dropped as `pod_limit`. 0: discover none.",
    )
    max_discovered_sources: int = Field(
        4096,
        ge=0,
        description="Most DP ranks (sources, a worker each) of discovered pods followed at "
        "once; a new rank past it is dropped as `source_limit`. With the pod limit, the "
        "bound on what strangers' names can cost.",
    )
    discovered_idle_secs: float = Field(
        600.0,
        gt=0,
        description="A discovered pod with no message for this long is forgotten: no longer "
        "followed, removed from the registry, its blocks cleared. An engine that publishes "
        "again is discovered again (its first batch joins, with replay).",
    )
    replay_max_bytes: int = Field(
        256 << 20,
        ge=1024,
        description="Payload bytes one replay may hold until it is applied; past it the "
        "replay stops and the source is reset, as for a replay that cannot fill its range.",
    )
    replay_reply_timeout: float = Field(1.0, gt=0, description="Wait for each replay reply.")
    replay_total_timeout: float = Field(30.0, gt=0, description="Bound on one whole replay.")
    retry_base: float = Field(0.05, gt=0, description="First wait when the index is down.")
    retry_cap: float = Field(2.0, gt=0, description="Longest wait between index retries.")
    allow_endpoint_schemes: list[EndpointScheme] = Field(
        default_factory=list,
        description="Schemes besides tcp:// a pod's endpoints may have. Registering a pod "
        "makes the indexer connect where it says: an ipc:// path reaches sockets of this "
        "machine that no engine may have meant to offer, so only tcp:// is followed unless "
        "the operator allows more.",
    )

    @field_validator("bind")
    @classmethod
    def _bind(cls, endpoints: list[str]) -> list[str]:
        for endpoint in endpoints:
            if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"--bind {endpoint!r} must be a tcp:// or ipc:// endpoint")
        return endpoints

    def check_endpoints(self, pod: PodInfo) -> None:
        """Raise `EndpointRefused` for an endpoint of `pod` with a scheme not allowed."""
        events = pod.kv_events
        for name, endpoint in (
            ("endpoint", events.endpoint),
            ("replay_endpoint", events.replay_endpoint),
        ):
            if endpoint is None or endpoint.startswith("tcp://"):
                continue
            scheme = endpoint.partition("://")[0]
            if scheme in self.allow_endpoint_schemes:
                continue
            variable = env_var_name("indexer", ALLOW_SCHEME_FLAG)
            raise EndpointRefused(
                f"pod {pod.id}: kv_events.{name} {endpoint!r} is not a tcp:// endpoint, and "
                f"this indexer follows only tcp:// ones unless allowed: start it with "
                f"`{ALLOW_SCHEME_FLAG} {scheme}` ({variable}={scheme}) to follow {scheme}:// "
                "endpoints"
            )
