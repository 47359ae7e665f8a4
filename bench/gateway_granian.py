"""The gateway served by granian instead of its own server, for `bench.gateway --granian`.

    python -m bench.gateway_granian {rsgi,rsgi-rust,rsgi-nodisconnect,bare} \\
        <globalkv gateway flags>

The same gateway (`gateway.serving.launch.running_gateway`: the pooled upstream, the same
configuration and garbage-collector tuning) with granian's embedded server in front, on
the gateway's own event loop, so the process's CPU time is all of the serving:
- `rsgi`: an RSGI front for the inference routes: the body read whole, `Inference.handle`,
  the answer as bytes or the stream passed on piece by piece, the request's work cancelled
  when granian reports the client gone (`client_disconnect`), as the own server does from
  `connection_lost`. The front a switch to granian would ship.
- `rsgi-rust`: the same on granian's Rust task implementation (experimental in granian,
  Python < 3.12 only) instead of asyncio tasks.
- `rsgi-nodisconnect`: `rsgi-rust` without listening for the client's disconnect (a client
  that leaves no longer cancels the upstream calls): granian's best case, not shippable.
- `bare`: granian alone, answering the mocks' answer shapes at once: its ceiling, beside
  `bench.gateway_ceilings`' `asgi` (uvicorn) and `raw` (the own server's parser).

Other routes answer 404: this is a measuring instrument, not a product; see
`gateway.http.server` for what was decided from it. Over ASGI (granian serving a FastAPI app
with the inference routes) the gateway cost more still: `bench/results/gateway-granian.md`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import Sequence
from typing import Any

from bench.gateway_ceilings import ANSWER_BODY, SSE_EVENTS, streamed
from gateway.http.answer import Answer, pass_on, problem, too_large
from gateway.serving.inference import Inference
from gateway.serving.launch import running_gateway, tune_garbage_collection
from gateway.settings.config import GatewayConfig
from gateway.settings.flags import build_config
from gateway.standalone.cli import register

MODES = ("rsgi", "rsgi-rust", "rsgi-nodisconnect", "bare")


def _head(answer: Answer) -> list[tuple[str, str]]:
    return [("content-type", answer.media_type.decode("latin-1"))]


class RsgiFront:
    """Inference POSTs from RSGI to `Inference`, as `gateway.http.client_connection` serves them."""

    def __init__(self, inference: Inference, *, watch_disconnect: bool) -> None:
        self.inference = inference
        self.watch_disconnect = watch_disconnect

    async def __rsgi__(self, scope: Any, protocol: Any) -> None:
        if scope.path not in self.inference.paths or scope.method != "POST":
            answer = problem(404, f"{scope.path}: not served by this measuring front")
            protocol.response_bytes(answer.status, _head(answer), answer.body)
            return
        limit = self.inference.limit
        raw = await protocol()
        if len(raw) > limit:
            answer = too_large(limit)
            self.inference.refused(scope.path, answer)
            protocol.response_bytes(answer.status, _head(answer), answer.body)
            return
        work = self.inference.handle(scope.path, scope.headers.get("authorization"), raw)
        outcome = await (self._until_disconnect(protocol, work) if self.watch_disconnect else work)
        if outcome is None:
            return
        if outcome.rest is None:
            protocol.response_bytes(outcome.status, _head(outcome), outcome.body)
            return
        head = _head(outcome) + list(outcome.headers)
        transport = protocol.response_stream(outcome.status, head)
        await transport.send_bytes(outcome.body)
        await pass_on(outcome.rest, transport.send_bytes)

    @staticmethod
    async def _until_disconnect(protocol: Any, work: Any) -> Answer | None:
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(protocol.client_disconnect())
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if task.done():
            result: Answer = task.result()
            return result
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            outcome = await task
            if outcome.rest is not None:
                await outcome.rest.close("client_gone")
        return None


async def _bare(scope: Any, protocol: Any) -> None:
    """The mocks' answer shapes at once: granian's own cost, against `bench.gateway_ceilings`."""
    body = await protocol()
    if not streamed(body):
        protocol.response_bytes(200, [("content-type", "application/json")], ANSWER_BODY)
        return
    headers = [("content-type", "text/event-stream"), ("cache-control", "no-cache")]
    transport = protocol.response_stream(200, headers)
    for event in SSE_EVENTS:
        await transport.send_bytes(event)


def _server(target: Any, config: GatewayConfig, mode: str) -> Any:
    from granian.constants import HTTPModes, Interfaces, TaskImpl
    from granian.log import LogLevels
    from granian.server.embed import Server

    return Server(
        target,
        address=config.host,
        port=config.port,
        interface=Interfaces.RSGI,
        task_impl=TaskImpl.asyncio if mode == "rsgi" else TaskImpl.rust,
        http=HTTPModes.http1,
        websockets=False,
        backlog=2048,
        log_level=LogLevels.warning,
    )


async def _serve(mode: str, config: GatewayConfig) -> None:
    if mode == "bare":
        tune_garbage_collection()
        await _server(_bare, config, mode).serve()
        return
    async with running_gateway(config, None) as (gateway, _):
        target = RsgiFront(Inference(gateway), watch_disconnect=mode != "rsgi-nodisconnect")
        tune_garbage_collection()
        await _server(target, config, mode).serve()


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if not words or words[0] not in MODES:
        print(f"usage: python -m bench.gateway_granian {{{','.join(MODES)}}} FLAGS…")
        return 2
    parser = argparse.ArgumentParser(prog="python -m bench.gateway_granian")
    register(parser.add_subparsers())
    args = parser.parse_args(["gateway", *words[1:]])
    import uvloop

    uvloop.run(_serve(words[0], build_config(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
