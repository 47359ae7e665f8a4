"""Which Kubernetes pods are workers, with sglang-router's service-discovery semantics.

The settings are sglang-router 0.3.2's flags: `--prefill-selector` and `--decode-selector`
(`key=value` labels, every one must match; an empty selector matches nothing), the worker
port `--service-discovery-port` (80 by default, as there), `--service-discovery-namespace`
(every namespace when absent) and `--bootstrap-port-annotation`. A pod that matches both
selectors is a prefill, as there.

A pod is a worker while it is Running, not being deleted, has a pod IP and its `Ready`
condition is True: that is when its engine answers, and the kubelet takes Ready away when
its readiness probe fails, so a worker that stops answering leaves the pool. (sglang-router
removes a worker only when its pod is deleted; a pod that merely loses Ready stays routed
to there.) A pod whose annotation names a bootstrap port that is not a port is refused
rather than given none: routing a prefill with the wrong bootstrap port fails every
request it serves, while a refused pod is logged and counted.

The watching itself is in `globalkv.discovery.kube_watch`, which imports these rules and is
imported only by `kube_source.open_source`, so that everything here works without the
`kubernetes` extra.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from globalkv.discovery.model import DiscoveredWorker, Role
from kvplumbing.backoff import Backoff

if TYPE_CHECKING:
    from lightkube.resources.core_v1 import Pod

DEFAULT_PORT = 80
DEFAULT_BOOTSTRAP_PORT_ANNOTATION = "sglang.ai/bootstrap-port"

_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_LABEL_KEY = re.compile(rf"([a-z0-9]([-a-z0-9.]{{0,251}}[a-z0-9])?/)?{_NAME}", re.ASCII)
_LABEL_VALUE = re.compile(rf"({_NAME})?", re.ASCII)


def parse_selector(items: Iterable[str]) -> dict[str, str]:
    """`key=value` items (each may hold several, comma-separated, as kubectl writes them)
    as a selector, or ValueError naming the item that is not one."""
    selector: dict[str, str] = {}
    for item in items:
        for pair in item.split(","):
            key, equals, value = pair.partition("=")
            if not equals:
                raise ValueError(f"label selector {pair!r} is not key=value")
            if not _LABEL_KEY.fullmatch(key):
                raise ValueError(f"label selector {pair!r}: {key!r} is not a label key")
            if not _LABEL_VALUE.fullmatch(value):
                raise ValueError(f"label selector {pair!r}: {value!r} is not a label value")
            selector[key] = value
    return selector


def selector_query(selector: Mapping[str, str]) -> str:
    """The `labelSelector` query value the API server filters by."""
    return ",".join(f"{key}={value}" for key, value in sorted(selector.items()))


def matches(selector: Mapping[str, str], labels: Mapping[str, str] | None) -> bool:
    """Every label of `selector` on the pod; an empty selector matches nothing."""
    return bool(selector) and labels is not None and selector.items() <= labels.items()


@dataclass(frozen=True, slots=True)
class KubernetesDiscovery:
    """What to watch and how; `kube_source.open_source` turns it into a running source."""

    prefill_selector: Mapping[str, str]
    decode_selector: Mapping[str, str]
    port: int = DEFAULT_PORT
    decode_port: int | None = None
    """A decode pod's port where it is not `port`: its sidecar, for an endpoint picker."""
    namespace: str | None = None
    bootstrap_port_annotation: str = DEFAULT_BOOTSTRAP_PORT_ANNOTATION
    max_workers: int = 4096
    """A list past this many workers keeps the first by id and counts the rest: a selector
    that matches a whole cluster by mistake must not flood the gateway."""
    watch_timeout: float = 300.0
    """Each watch ends after this long (asked of the server, and enforced here, since a
    connection that silently died would otherwise wait forever) and resumes from the last
    resourceVersion seen."""
    backoff: Backoff = field(default_factory=lambda: Backoff.spread(0.5, 30.0, 2.0, 0.2))
    """The pause between tries while the API server fails or cannot be reached."""

    def __post_init__(self) -> None:
        if not (self.prefill_selector or self.decode_selector):
            raise ValueError("Kubernetes discovery needs a prefill or a decode selector")
        for port in (self.port, self.decode_port or self.port):
            if not 1 <= port <= 65535:
                raise ValueError(f"service discovery port {port} is not 1-65535")
        if self.namespace == "":
            raise ValueError("service discovery namespace must not be empty")
        if self.max_workers < 1 or self.watch_timeout <= 0:
            raise ValueError("max_workers and watch_timeout must be positive")


class PodRejected(ValueError):
    """A pod that would be a worker but states something unusable: `kind` says what, in a
    few words to count it by; the message names the pod."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def role_of(settings: KubernetesDiscovery, labels: Mapping[str, str] | None) -> Role | None:
    if matches(settings.prefill_selector, labels):
        return "prefill"
    if matches(settings.decode_selector, labels):
        return "decode"
    return None


def pod_worker(settings: KubernetesDiscovery, pod: Pod) -> DiscoveredWorker | None:
    """The worker `pod` is, None while it is not one (pending, unready, terminating,
    unmatched), or `PodRejected` when it states something unusable."""
    meta, status = pod.metadata, pod.status
    if meta is None or status is None or meta.deletionTimestamp is not None:
        return None
    role = role_of(settings, meta.labels)
    ready = any(c.type == "Ready" and c.status == "True" for c in status.conditions or ())
    if role is None or status.phase != "Running" or not ready:
        return None
    if not meta.name or not meta.namespace:
        raise PodRejected("no name", "a Running, Ready pod without a name or namespace")
    pod_id = f"{meta.namespace}/{meta.name}"
    if not status.podIP:
        raise PodRejected("no pod IP", f"pod {pod_id} is Running and Ready without a pod IP")
    try:
        ip = ipaddress.ip_address(status.podIP)
    except ValueError:
        raise PodRejected(
            "bad pod IP", f"pod {pod_id} has pod IP {status.podIP[:60]!r}, not an address"
        ) from None
    host = f"[{ip}]" if ip.version == 6 else str(ip)
    bootstrap_port = None
    annotation = (meta.annotations or {}).get(settings.bootstrap_port_annotation)
    if role == "prefill" and annotation is not None:
        bootstrap_port = _port(annotation)
        if bootstrap_port is None:
            raise PodRejected(
                "bad bootstrap port",
                f"pod {pod_id}: annotation {settings.bootstrap_port_annotation}="
                f"{annotation[:40]!r} is not a port (1-65535)",
            )
    port = settings.decode_port if role == "decode" and settings.decode_port else settings.port
    return DiscoveredWorker(
        id=pod_id,
        url=f"http://{host}:{port}",
        role=role,
        bootstrap_port=bootstrap_port,
    )


def _port(text: str) -> int | None:
    value = text.strip()
    if not value.isascii() or not value.isdigit() or len(value) > 5:
        return None
    port = int(value)
    return port if 1 <= port <= 65535 else None
