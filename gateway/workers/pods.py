"""Registering workers as pods with the index: indexer API or shared registry.

The indexer subscribes to a pod's KV events once it knows the pod; the gateway is where
operators add workers (prefills, and decodes that publish KV events), so it tells the
indexer — through `POST /v1/pods` with
`--indexer-url`, or by writing the registry stored with the index with `--redis-url`.
Both paths send the same `globalkv.registry.PodInfo`.
"""

from __future__ import annotations

from urllib.parse import quote

import httpx
from pydantic import ValidationError

from gateway.workers.monitor import PodRegistration, RegistrationFailed
from globalkv.index.base import IndexUnavailable
from globalkv.registry import KvEventsConfig, PodInfo, Registry
from kvplumbing.environment import env_var_name
from kvplumbing.validation import validation_message

INDEXER_TOKEN_VARIABLE = env_var_name("gateway", "--indexer-token")


def pod_info(pod: PodRegistration) -> PodInfo:
    """The registry's record; `RegistrationFailed` for what it cannot hold (an endpoint
    the worker advertised that the indexer could not connect to, say)."""
    try:
        return PodInfo(
            id=pod.id,
            model=pod.model or "",
            block_size=pod.block_size,
            role=pod.role,
            url=pod.url,
            bootstrap_host=pod.bootstrap_host,
            bootstrap_port=pod.bootstrap_port,
            kv_events=KvEventsConfig(
                endpoint=pod.kv_events.endpoint,
                replay_endpoint=pod.kv_events.replay_endpoint,
                topic=pod.kv_events.topic,
                mode=pod.kv_events.mode,
            ),
            dp_size=pod.dp_size,
        )
    except ValidationError as exc:
        raise RegistrationFailed(f"pod {pod.id}: {validation_message(exc)}") from None


class HttpPodRegistrar:
    def __init__(
        self,
        client: httpx.AsyncClient,
        indexer_url: str,
        *,
        token: str | None = None,
        timeout: float = 5.0,
    ) -> None:
        self._client = client
        self._base = indexer_url.rstrip("/") + "/v1/pods"
        self._headers = {"authorization": f"Bearer {token}"} if token else {}
        self._timeout = timeout

    async def register(self, pod: PodRegistration) -> None:
        body = pod_info(pod).model_dump(mode="json")
        try:
            response = await self._client.post(
                self._base, json=body, headers=self._headers, timeout=self._timeout
            )
        except httpx.HTTPError as exc:
            raise RegistrationFailed(f"indexer unreachable: {exc!r}") from exc
        if response.status_code >= 300:
            raise _refused(response)

    async def unregister(self, pod_id: str) -> None:
        try:
            response = await self._client.delete(
                f"{self._base}/{quote(pod_id, safe='')}",
                headers=self._headers,
                timeout=self._timeout,
            )
        except httpx.HTTPError as exc:
            raise RegistrationFailed(f"indexer unreachable: {exc!r}") from exc
        if response.status_code >= 300 and response.status_code != 404:
            raise _refused(response)

    async def listed(self) -> set[str]:
        try:
            response = await self._client.get(
                self._base, headers=self._headers, timeout=self._timeout
            )
        except httpx.HTTPError as exc:
            raise RegistrationFailed(f"indexer unreachable: {exc!r}") from exc
        if response.status_code != 200:
            raise _refused(response)
        try:
            pods = response.json()["pods"]
            return {str(pod["id"]) for pod in pods}
        except (ValueError, KeyError, TypeError) as exc:
            raise RegistrationFailed(f"indexer's pod list unreadable: {exc!r}") from exc


def _refused(response: httpx.Response) -> RegistrationFailed:
    """The indexer's answer in words; a 401 or 403 also says what this side must set (the
    indexer's own words, which name its flags, are kept whole)."""
    status = response.status_code
    if status in (401, 403):
        return RegistrationFailed(
            f"indexer answered {status}: {response.text[:1000]}; give the gateway the "
            f"indexer's admin token with `--indexer-token` ({INDEXER_TOKEN_VARIABLE})"
        )
    return RegistrationFailed(f"indexer answered {status}: {response.text[:200]}")


class RegistryPodRegistrar:
    """Writes the registry stored with the index (the shared Redis one with --redis-url)."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    async def register(self, pod: PodRegistration) -> None:
        info = pod_info(pod)
        try:
            await self._registry.put(info)
        except IndexUnavailable as exc:
            raise RegistrationFailed(str(exc)) from exc

    async def unregister(self, pod_id: str) -> None:
        try:
            await self._registry.remove(pod_id)
        except IndexUnavailable as exc:
            raise RegistrationFailed(str(exc)) from exc

    async def listed(self) -> set[str]:
        try:
            return {pod.id for pod in await self._registry.list()}
        except IndexUnavailable as exc:
            raise RegistrationFailed(str(exc)) from exc
