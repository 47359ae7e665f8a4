"""Stage 2: each prefill's bootstrap directory, as a decode will meet it.

A decode needs the directory reachable and complete, then the address of every rank it
pairs with, then a connection to each. So for every prefill this stage reads readiness,
topology and missing ranks (`bootstrap.reader`, which understands ours and real SGLang's),
asks the directory for every rank's address with the same `GET /route` a decode sends,
and opens a TCP connection to each address.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel, ValidationError

from bootstrap.protocol import ROUTE_PARAMS
from bootstrap.reader import DirectoryReport
from globalkv.stack.doctor.reading import Connect, Reader
from globalkv.stack.doctor.report import Level, Stage
from globalkv.stack.views import PodsView, WorkersView

MAX_RANKS = 512
"""Bound on the rank addresses checked per directory."""


class DirectoryProbe(Protocol):
    async def read(self, bootstrap_url: str) -> DirectoryReport: ...


@dataclass(frozen=True, slots=True)
class Target:
    subject: str
    url: str | None
    """The directory's base URL; None when no bootstrap port is known."""
    vllm: bool = False
    """A vLLM prefill: its decodes pull the KV where its answer says, no directory."""


class _RankAddress(BaseModel):
    rank_ip: str
    rank_port: int


def _base(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"http://{shown}:{port}"


def targets_from_workers(listing: WorkersView) -> list[Target]:
    targets = []
    for worker in listing.workers:
        if worker.role != "prefill":
            continue
        subject = f"prefill {worker.id}" + (f" (pod {worker.pod})" if worker.pod else "")
        if worker.kind == "vllm":
            targets.append(Target(subject, None, vllm=True))
            continue
        port = worker.directory_port or worker.bootstrap_port
        host = worker.bootstrap_host
        targets.append(Target(subject, _base(host, port) if host and port else None))
    return targets


def targets_from_pods(listing: PodsView) -> list[Target]:
    return [
        Target(
            f"pod {pod.id}",
            _base(pod.bootstrap_host, pod.bootstrap_port)
            if pod.bootstrap_host and pod.bootstrap_port
            else None,
        )
        for pod in listing.pods
    ]


def _coordinates(topology: dict[str, Any]) -> list[tuple[int, int, int, int]]:
    keys = ("dp_size", "attn_cp_size", "attn_tp_size", "pp_size")
    dp, cp, tp, pp = (
        size if isinstance(size, int) and size > 0 else 1 for size in map(topology.get, keys)
    )
    every = itertools.product(range(dp), range(cp), range(tp), range(pp))
    return list(itertools.islice(every, MAX_RANKS))


def _name(coordinate: tuple[int, ...]) -> str:
    return " ".join(f"{k}{v}" for k, v in zip(("dp", "cp", "tp", "pp"), coordinate, strict=True))


class DirectoryCheck:
    def __init__(
        self, reader: Reader, probe: DirectoryProbe, connect: Connect, *, timeout: float
    ) -> None:
        self._reader = reader
        self._probe = probe
        self._connect = connect
        self._timeout = timeout

    async def run(self, stage: Stage, targets: list[Target]) -> None:
        if not targets:
            stage.fail("prefills", "none known: no prefill worker or pod to check")
            return
        for target, (level, message) in zip(
            targets, await asyncio.gather(*(self._one(t) for t in targets)), strict=True
        ):
            stage.add(level, target.subject, message)

    async def _one(self, target: Target) -> tuple[Level, str]:
        if target.vllm:
            return Level.SKIP, "vLLM: no bootstrap directory (kv_transfer_params protocol)"
        if target.url is None:
            return Level.WARN, "no bootstrap port known: its readiness cannot be checked"
        status = await self._probe.read(target.url)
        where = f"directory {target.url}"
        if not status.reachable:
            return Level.FAIL, f"{where} unreachable: {status.error}"
        if status.error is not None:
            return Level.FAIL, f"{where}: {status.error}"
        if not status.ready or status.topology is None:
            expected = "?" if status.expected is None else status.expected
            missing = ", ".join(_name(c) for c in status.missing[:8]) or "unknown"
            return (
                Level.FAIL,
                f"{where} not ready: {status.registered}/{expected} ranks registered, "
                f"missing {missing}; decodes wait for it, the gateway sends it nothing",
            )
        coordinates = _coordinates(status.topology)
        problems = [
            p for p in await asyncio.gather(*(self._rank(target.url, c) for c in coordinates)) if p
        ]
        shape = "×".join(
            str(status.topology.get(k)) for k in ("dp_size", "attn_cp_size", "attn_tp_size")
        )
        shape += f"×{status.topology.get('pp_size')} (dp×cp×tp×pp)"
        if problems:
            shown = "; ".join(problems[:4]) + (" …" if len(problems) > 4 else "")
            return (
                Level.FAIL,
                f"{where} ready ({shape}) but {len(problems)} of {len(coordinates)} ranks "
                f"fail: {shown}",
            )
        return (
            Level.OK,
            f"{where} ready ({status.flavor or 'unknown'} directory, {shape}); all "
            f"{len(coordinates)} rank addresses accept connections",
        )

    async def _rank(self, url: str, coordinate: tuple[int, int, int, int]) -> str | None:
        params = dict(zip(ROUTE_PARAMS, map(str, coordinate), strict=True))
        query = "&".join(f"{k}={v}" for k, v in params.items())
        response = await self._reader.get(f"{url}/route?{query}")
        if isinstance(response, str):
            return f"{_name(coordinate)}: /route {response}"
        if response.status_code != 200:
            return f"{_name(coordinate)}: /route answered HTTP {response.status_code}"
        try:
            address = _RankAddress.model_validate_json(response.content)
        except ValidationError:
            return f"{_name(coordinate)}: /route answered an unexpected body"
        problem = await self._connect(address.rank_ip, address.rank_port, self._timeout)
        if problem is not None:
            where = f"{address.rank_ip}:{address.rank_port}"
            return f"{_name(coordinate)} at {where} unreachable ({problem})"
        return None
