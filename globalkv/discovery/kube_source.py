"""Opening a Kubernetes source: the one door to pod discovery that stays importable without
the `kubernetes` extra.

It checks the extra before importing the watcher (`kube_watch`, built on lightkube), so a
missing extra is one line naming it rather than an ImportError. It sits apart from the pod
rules (`kubernetes`), which the watcher imports: the rules never import the watcher back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from globalkv.discovery.kubernetes import KubernetesDiscovery
from globalkv.extras import require

if TYPE_CHECKING:
    from lightkube import AsyncClient

    from globalkv.discovery.kube_watch import KubernetesSource


def open_source(
    settings: KubernetesDiscovery, *, client: AsyncClient | None = None
) -> KubernetesSource:
    """A source watching pods by `settings`, through `client` (default: the in-cluster
    service account, else `KUBECONFIG`, else `~/.kube/config`). Use it as
    `async with open_source(...) as source: async for snapshot in source.snapshots(): ...`.
    Without the `kubernetes` extra this raises `MissingExtra`, whose one line says what to
    install."""
    require("Kubernetes service discovery", "kubernetes", "lightkube")
    from globalkv.discovery.kube_watch import KubernetesSource

    return KubernetesSource(settings, client=client)
