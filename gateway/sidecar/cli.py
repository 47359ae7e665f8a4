"""`globalkv sidecar`: the entry of a decode engine, binding each request to a prefill.

    globalkv sidecar --port 8000 --decode http://127.0.0.1:8200 \\
        --prefill http://10.0.0.1:30000 8998 --prefill http://10.0.0.2:30000 8998 \\
        --redis-url redis://redis:6379/0 --block-size 16

Runs in front of one decode engine (`--decode URL` or `--vllm-decode URL`, exactly one),
behind an endpoint picker that chose this decode (Envoy and `globalkv epp`, or llm-d's).
It serves the gateway's endpoints (`/generate`, `/v1/completions`,
`/v1/chat/completions`, streamed or not) and its other routes, takes the gateway's flags,
and runs the gateway's legs with a chooser whose decode is the local engine
(`gateway.sidecar.chooser`): the prefill named in `x-globalkv-prefill` or
`x-prefiller-host-port`, else the prefill policy's choice with the index.
"""

from __future__ import annotations

import argparse
from typing import Any

from gateway.routing.router import Router
from gateway.serving.inference import Inference
from gateway.serving.launch import (
    add_command,
    launch,
    running_gateway,
    serve_until_signalled,
)
from gateway.settings.checks import check_gateway
from gateway.settings.config import GatewayConfig
from gateway.settings.flags import add_flags, build_config
from gateway.sidecar.chooser import SidecarChooser
from gateway.workers.pool import worker_id
from globalkv.tokenize import Tokenizer


def build_sidecar_config(args: argparse.Namespace) -> GatewayConfig:
    config = build_config(args)
    if len(config.decode) != 1:
        raise ValueError("give the local decode engine: exactly one --decode or --vllm-decode")
    return config


async def serve(config: GatewayConfig, tokenizer: Tokenizer | None) -> None:
    local = worker_id(config.decode[0].url)

    def chooser(router: Router) -> SidecarChooser:
        return SidecarChooser(router, local)

    async with running_gateway(config, tokenizer, chooser) as (gateway, app):
        await serve_until_signalled("sidecar", config, Inference(gateway, named_prefill=True), app)


def check_config(args: argparse.Namespace) -> list[str]:
    config = build_sidecar_config(args)
    local = f"local decode: {config.decode[0].url}, bound to the prefill the picker names"
    return [local, *check_gateway(config, load_tokenizer=args.check)]


def run(args: argparse.Namespace) -> int:
    return launch(args, build_sidecar_config(args), "sidecar", serve)


def register(subparsers: Any) -> None:
    summary = "in front of one decode engine: binds each request to a prefill, PD legs"
    add_command(subparsers, "sidecar", summary, __doc__, add_flags, run, check_config)
