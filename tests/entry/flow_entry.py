"""A gateway's handler or an endpoint picker with flow control, over fake workers, driven
alike: a request is sent by name; one let through (picked, or arrived at its decode) holds
its place until the test ends it; what waited and what went through can be awaited."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from gateway.epp.picker import Pick, Picker
from gateway.flow.control import FlowControl
from gateway.flow.queues import FlowRequest
from gateway.http.answer import Answer
from gateway.replicas.shared_state import SharedState
from gateway.serving.inference import Inference
from gateway.serving.intake import Waiting
from gateway.serving.service import Gateway
from tests.gateway.fakes import DECODES, Cluster, config, make_gateway
from tests.support.clock import FakeClock

KINDS = ("gateway", "picker")


class FlowEntry:
    """`kind` "gateway" (the handler, calling the fake workers) or "picker" (picks only);
    `order`: the requests let through, in order."""

    def __init__(self, kind: str, gateway: Gateway, cluster: Cluster) -> None:
        assert gateway.flow is not None, "built with --flow-control"
        self.kind = kind
        self.gateway = gateway
        self.flow: FlowControl = gateway.flow
        self.shared: SharedState | None = None
        self.order: list[str] = []
        self._gates: dict[str, asyncio.Event] = {}
        self._picks: dict[str, Pick] = {}
        self._waited = 0
        self._changed = asyncio.Condition()
        self.picker = Picker(gateway) if kind == "picker" else None
        self.inference = Inference(gateway) if kind == "gateway" else None
        enter = self.flow.enter

        async def entering(request: FlowRequest, waiting: Waiting = None) -> Any:
            async def told() -> None:
                async with self._changed:
                    self._waited += 1
                    self._changed.notify_all()
                if waiting is not None:
                    await waiting()

            return await enter(request, told)

        self.flow.enter = entering  # type: ignore[method-assign]

        async def held(_: httpx.Request, payload: Any) -> httpx.Response:
            name = payload["text"].split(" ", 1)[0]
            await self._let_through(name)
            await self._gates.setdefault(name, asyncio.Event()).wait()
            return httpx.Response(200, json={"room": payload["bootstrap_room"]})

        for url in DECODES:
            cluster.on(url, held)

    async def _let_through(self, name: str) -> None:
        async with self._changed:
            self.order.append(name)
            self._changed.notify_all()

    def send(
        self,
        name: str,
        headers: dict[str, str] | None = None,
        *,
        size: int = 40,
        authorization: str | None = None,
        **fields: Any,
    ) -> asyncio.Task[Pick | Answer]:
        """A `/generate` request whose text starts with `name`, `size` bytes of it."""
        text = f"{name} " + "x" * max(size - len(name) - 1, 0)
        payload = {"text": text, "sampling_params": {"max_new_tokens": 1}, **fields}
        body = json.dumps(payload).encode()
        given = dict(headers or {})
        if self.picker is not None:
            if authorization is not None:
                given["authorization"] = authorization
            return asyncio.create_task(self._pick(name, body, given))
        assert self.inference is not None
        picked = tuple((k.encode(), v.encode()) for k, v in given.items())
        handled = self.inference.handle("/generate", authorization, body, picked)
        return asyncio.create_task(handled)

    async def _pick(self, name: str, body: bytes, headers: dict[str, str]) -> Pick | Answer:
        assert self.picker is not None
        pick = await self.picker.pick("/generate", body, None, headers)
        if isinstance(pick, Pick):
            self._picks[name] = pick
            await self._let_through(name)
        return pick

    def end(self, name: str) -> None:
        """The answer of `name` is over: its place goes to the next."""
        if self.picker is not None:
            self.picker.release(self._picks.pop(name), True)
        else:
            self._gates.setdefault(name, asyncio.Event()).set()

    async def waited(self, count: int) -> None:
        """Until `count` requests have started waiting in its queues (at most 5 s)."""
        async with asyncio.timeout(5), self._changed:
            await self._changed.wait_for(lambda: self._waited >= count)

    async def through(self, count: int) -> None:
        """Until `count` requests have been let through (at most 5 s)."""
        async with asyncio.timeout(5), self._changed:
            await self._changed.wait_for(lambda: len(self.order) >= count)


async def flow_entry(
    kind: str, cluster: Cluster | None = None, clock: FakeClock | None = None, **settings: Any
) -> FlowEntry:
    """An entry of `kind` on a gateway of `config(**settings)` (flow control among them)."""
    cluster = cluster or Cluster()
    gateway = await make_gateway(cluster, config(**settings), clock=clock)
    return FlowEntry(kind, gateway, cluster)


def status(outcome: Pick | Answer) -> int:
    """The status a request's outcome is answered with (a pick: 200, as the fakes answer)."""
    return 200 if isinstance(outcome, Pick) else outcome.status
