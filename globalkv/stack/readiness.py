"""When a local cluster is ready: every condition the first request depends on.

- the indexer and every engine answer `/health`;
- every prefill's bootstrap directory is complete (a decode cannot resolve a room before);
- every gateway (and, with the envoy entry, every picker and sidecar) lists each of its
  workers as eligible and has registered each prefill as its pod with the index;
- Envoy (the envoy entry) answers `/health` through a picker and a sidecar;
- the indexer follows each of those pods and is subscribed to its events.

`pending()` says in plain words what does not hold yet; the cluster polls it and shows
the last answer when the start times out.
"""

from __future__ import annotations

from typing import TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from globalkv.stack.plan import Component, Plan
from globalkv.stack.views import DirectoryView, PodsView, WorkersView

_View = TypeVar("_View", bound=BaseModel)
_TIMEOUT = 2.0


class Readiness:
    def __init__(self, plan: Plan, client: httpx.Client, *, token: str | None = None) -> None:
        """`token`: the cluster's admin token, which the gateway's `/workers` then needs."""
        self._plan = plan
        self._client = client
        self._gateway_headers = {"authorization": f"Bearer {token}"} if token else {}

    def pending(self) -> list[str]:
        """What is not ready yet; empty once the whole cluster is."""
        reasons: list[str] = []
        for component in self._plan.components:
            if component.role == "gateway":
                continue
            problem = self._healthy(component.url)
            if problem is not None:
                reasons.append(f"{component.name}: /health {problem}")
            elif component.bootstrap_url is not None:
                reasons.extend(self._directory(component.name, component.bootstrap_url))
        if reasons:
            return reasons
        return self._gateway() or self._pods()

    def _healthy(self, url: str) -> str | None:
        try:
            response = self._client.get(f"{url}/health", timeout=_TIMEOUT)
        except httpx.HTTPError as exc:
            return f"unreachable ({type(exc).__name__})"
        return None if response.status_code == 200 else f"answered {response.status_code}"

    def _read(
        self, url: str, view: type[_View], headers: dict[str, str] | None = None
    ) -> _View | str:
        try:
            response = self._client.get(url, headers=headers, timeout=_TIMEOUT)
        except httpx.HTTPError as exc:
            return f"unreachable ({type(exc).__name__})"
        if response.status_code != 200:
            return f"answered {response.status_code}"
        try:
            return view.model_validate_json(response.content)
        except ValidationError:
            return "answered something unexpected"

    def _directory(self, name: str, bootstrap_url: str) -> list[str]:
        directory = self._read(f"{bootstrap_url}/v1/directory", DirectoryView)
        if isinstance(directory, str):
            return [f"{name}: bootstrap directory {directory}"]
        if not directory.ready:
            expected = "?" if directory.expected is None else directory.expected
            return [f"{name}: bootstrap directory has {directory.registered}/{expected} ranks"]
        return []

    def _gateway(self) -> list[str]:
        reasons = []
        for component in self._plan.components:
            if component.workers:
                reasons += self._one_gateway(component)
        if reasons:
            return reasons
        for gateway in self._plan.gateways:
            if not gateway.workers:  # Envoy: ready once a request crosses it
                problem = self._healthy(gateway.url)
                if problem is not None:
                    reasons.append(f"{gateway.name}: /health through it {problem}")
        return reasons

    def _one_gateway(self, component: Component) -> list[str]:
        name = component.name
        listing = self._read(f"{component.url}/workers", WorkersView, self._gateway_headers)
        if isinstance(listing, str):
            return [f"{name}: /workers {listing}"]
        by_url = {w.url: w for w in listing.workers}
        named = {c.url: c for c in self._plan.components}
        reasons = []
        for url in component.workers:
            engine, worker = named[url], by_url.get(url)
            if worker is None:
                reasons.append(f"{name}: does not list {engine.name} ({engine.url})")
            elif not worker.eligible:
                state = f"health {worker.health}, circuit {worker.circuit}"
                if worker.directory is not None:
                    state += f", directory {worker.directory}"
                reasons.append(f"{name}: {engine.name} not eligible yet ({state})")
            elif engine.pod is not None and worker.registered_pod != engine.pod:
                reasons.append(f"{name}: has not registered {engine.name} with the index yet")
        return reasons

    def _pods(self) -> list[str]:
        listing = self._read(f"{self._plan.indexer.url}/v1/pods", PodsView)
        if isinstance(listing, str):
            return [f"indexer: /v1/pods {listing}"]
        pods = {p.id: p for p in listing.pods}
        reasons = []
        for prefill in self._plan.by_role("prefill"):
            assert prefill.pod is not None
            pod = pods.get(prefill.pod)
            if pod is None:
                reasons.append(f"indexer: does not follow pod {prefill.pod} yet")
            elif pod.state is None or not pod.state.subscribed:
                reasons.append(f"indexer: not subscribed to pod {prefill.pod} yet")
        return reasons
