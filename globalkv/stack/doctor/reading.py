"""Reading a live component for `doctor`: JSON views, status codes, Prometheus samples.

Every read returns either what was read or a short description of what went wrong
(unreachable, a status, a body of the wrong shape): a diagnosis must go on past a
broken component and say what it saw, never stop at the first exception.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ValidationError

from kvplumbing.describe import describe_error

View = TypeVar("View", bound=BaseModel)
Connect = Callable[[str, int, float], Awaitable[str | None]]
"""(host, port, timeout) → None when a TCP connection opens, else why it did not."""


async def tcp_connect(host: str, port: int, timeout: float) -> str | None:
    try:
        async with asyncio.timeout(timeout):
            _, writer = await asyncio.open_connection(host, port)
    except (OSError, TimeoutError) as exc:
        return describe_error(exc)
    writer.close()
    try:
        await writer.wait_closed()
    except OSError as exc:
        return f"connected, then {describe_error(exc)}"
    return None


@dataclass(frozen=True, slots=True)
class Samples:
    """A scrape of a Prometheus endpoint: sample name and labels → value."""

    values: Mapping[tuple[str, frozenset[tuple[str, str]]], float]

    @classmethod
    def parse(cls, text: str) -> Samples:
        values: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                values[(sample.name, frozenset(sample.labels.items()))] = float(sample.value)
        return cls(values)

    def matching(self, name: str, **labels: str) -> Iterable[tuple[dict[str, str], float]]:
        wanted = set(labels.items())
        for (sample, label_set), value in self.values.items():
            if sample == name and wanted <= label_set:
                yield dict(label_set), value

    def total(self, name: str, **labels: str) -> float:
        return sum(value for _, value in self.matching(name, **labels))

    def minus(self, before: Samples) -> Samples:
        """Counter increases since `before` (series absent before count from 0)."""
        return Samples({k: v - before.values.get(k, 0.0) for k, v in self.values.items()})


class Reader:
    def __init__(
        self,
        client: httpx.AsyncClient,
        *,
        timeout: float,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.client = client
        self.timeout = timeout
        self.headers = dict(headers or {})

    async def get(self, url: str) -> httpx.Response | str:
        try:
            return await self.client.get(url, headers=self.headers, timeout=self.timeout)
        except httpx.HTTPError as exc:
            return f"unreachable ({describe_error(exc)})"

    async def post(self, url: str, body: object) -> httpx.Response | str:
        try:
            return await self.client.post(
                url, json=body, headers=self.headers, timeout=self.timeout
            )
        except httpx.HTTPError as exc:
            return f"unreachable ({describe_error(exc)})"

    async def view(self, url: str, view: type[View]) -> View | str:
        response = await self.get(url)
        if isinstance(response, str):
            return response
        if response.status_code != 200:
            return f"answered HTTP {response.status_code}: {response.text.strip()[:200]}"
        try:
            return view.model_validate_json(response.content)
        except ValidationError as exc:
            return f"answered an unexpected body ({exc.error_count()} problems)"

    async def healthy(self, url: str) -> str | None:
        """None when `GET url` answers 200, else what happened."""
        response = await self.get(url)
        if isinstance(response, str):
            return response
        if response.status_code != 200:
            return f"answered HTTP {response.status_code}"
        return None

    async def samples(self, url: str) -> Samples | str:
        response = await self.get(url)
        if isinstance(response, str):
            return response
        if response.status_code != 200:
            return f"answered HTTP {response.status_code}"
        try:
            return Samples.parse(response.text)
        except ValueError as exc:
            return f"sent unparsable metrics ({describe_error(exc)})"
