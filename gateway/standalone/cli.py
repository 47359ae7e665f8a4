"""`globalkv gateway`: sglang-router's PD flags as they are, plus the index's.

    globalkv gateway --pd-disaggregation \\
        --prefill http://10.0.0.1:30001 8998 --prefill http://10.0.0.2:30001 none \\
        --decode http://10.0.0.3:30011 --indexer-url http://10.0.0.9:8100

The gateway standing alone in front of the workers, in sglang-router's place: its own HTTP
server receives each request and it runs the PD legs. The flags are
`gateway.settings.flags`' (read there only; everything else takes `GatewayConfig`); the
gateway is built from its configuration, served and stopped on a signal as every entry
point is (`gateway.serving.launch`).
"""

from __future__ import annotations

import argparse
from typing import Any

from gateway.serving.inference import Inference
from gateway.serving.launch import add_command, launch, running_gateway, serve_until_signalled
from gateway.settings.checks import check_gateway
from gateway.settings.config import GatewayConfig
from gateway.settings.flags import add_flags, build_config
from globalkv.tokenize import Tokenizer


def check_config(args: argparse.Namespace) -> list[str]:
    return check_gateway(build_config(args), load_tokenizer=args.check)


async def serve(config: GatewayConfig, tokenizer: Tokenizer | None) -> None:
    async with running_gateway(config, tokenizer) as (gateway, app):
        await serve_until_signalled("gateway", config, Inference(gateway), app)


def run(args: argparse.Namespace) -> int:
    return launch(args, build_config(args), "gateway", serve)


def register(subparsers: Any) -> None:
    summary = "the PD gateway (sglang-router compatible flags)"
    add_command(subparsers, "gateway", summary, __doc__, add_flags, run, check_config)
