"""The control plane's view of a directory: reachable, ready, topology, missing ranks.

The gateway and `globalkv doctor` poll many directories, some of them real SGLang
prefills, so `read` never raises for a remote problem: whatever happened is in the
returned status. globalkv's own directory answers `GET /v1/directory` with the whole
table; a real SGLang directory has no such path, and its four -1 snapshot is the only
readiness signal it offers (where a duplicate registration can already read as ready,
because SGLang counts PUTs).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, ValidationError

from bootstrap.protocol import SNAPSHOT_QUERY, Topology
from kvplumbing.describe import describe_answer, describe_error
from kvplumbing.validation import validation_message

Flavor = Literal["globalkv", "sglang"]
_REGISTERED = re.compile(r"\((\d+) workers registered\)")


@dataclass(frozen=True, slots=True)
class DirectoryReport:
    """What one read of a directory found; `topology` holds `Topology` fields (dp_size, …)."""

    url: str
    reachable: bool
    ready: bool
    topology: dict[str, Any] | None
    registered: int
    expected: int | None
    missing: list[tuple[int, int, int, int]]
    error: str | None
    flavor: Flavor | None = None
    """Which directory answered: ours (`/v1/directory`) or SGLang's (snapshot only)."""


class _DirectoryView(BaseModel):
    model_config = ConfigDict(extra="ignore")

    ready: bool
    topology: Topology | None
    registered: int
    expected: int | None
    missing: list[tuple[int, int, int, int]]


def _failed(url: str, error: str, *, reachable: bool, flavor: Flavor | None) -> DirectoryReport:
    return DirectoryReport(url, reachable, False, None, 0, None, [], error, flavor)


class DirectoryReader:
    def __init__(self, client: httpx.AsyncClient, *, timeout: float = 2.0) -> None:
        self._client = client
        self._timeout = timeout

    async def read(self, bootstrap_url: str) -> DirectoryReport:
        try:
            response = await self._client.get(
                f"{bootstrap_url}/v1/directory", timeout=self._timeout
            )
        except httpx.HTTPError as exc:
            return _failed(bootstrap_url, describe_error(exc), reachable=False, flavor=None)
        if response.status_code in (404, 405):
            return await self._read_snapshot(bootstrap_url)
        if response.status_code != 200:
            error = f"/v1/directory: {describe_answer(response)}"
            return _failed(bootstrap_url, error, reachable=True, flavor="globalkv")
        try:
            view = _DirectoryView.model_validate_json(response.content)
        except ValidationError as exc:
            error = f"invalid /v1/directory answer: {validation_message(exc)}"
            return _failed(bootstrap_url, error, reachable=True, flavor="globalkv")
        return DirectoryReport(
            url=bootstrap_url,
            reachable=True,
            ready=view.ready,
            topology=None if view.topology is None else view.topology.model_dump(),
            registered=view.registered,
            expected=view.expected,
            missing=view.missing,
            error=None,
            flavor="globalkv",
        )

    async def _read_snapshot(self, url: str) -> DirectoryReport:
        try:
            response = await self._client.get(
                f"{url}/route", params=SNAPSHOT_QUERY, timeout=self._timeout
            )
        except httpx.HTTPError as exc:
            return _failed(url, describe_error(exc), reachable=False, flavor="sglang")
        if response.status_code == 503:
            match = _REGISTERED.search(response.text)
            registered = int(match.group(1)) if match else 0
            return DirectoryReport(url, True, False, None, registered, None, [], None, "sglang")
        if response.status_code != 200:
            error = f"topology snapshot: {describe_answer(response)}"
            return _failed(url, error, reachable=True, flavor="sglang")
        try:
            topology = Topology.model_validate_json(response.content)
        except ValidationError as exc:
            error = f"invalid topology snapshot: {validation_message(exc)}"
            return _failed(url, error, reachable=True, flavor="sglang")
        return DirectoryReport(
            url=url,
            reachable=True,
            ready=True,
            topology=topology.model_dump(),
            registered=topology.expected,
            expected=topology.expected,
            missing=[],
            error=None,
            flavor="sglang",
        )
