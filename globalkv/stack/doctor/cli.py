"""`globalkv doctor`: walk a live cluster's diagnostic path and say what holds.

    globalkv doctor --gateway http://127.0.0.1:8000 [--indexer http://127.0.0.1:8100]
    globalkv doctor --run-dir runs/up-…        # the addresses a `globalkv up` recorded
    globalkv doctor --gateway http://epp:8080 --entry http://envoy:8000   # behind Envoy
    globalkv doctor … --admin-token T          # a gateway with an admin token

Exit status 0 when nothing failed (warnings allowed), 1 when something is wrong, 2 for
unusable arguments. Every flag also reads `GLOBALKV_DOCTOR_<FLAG>`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import Any

import httpx

from globalkv.stack.doctor.diagnose import Doctor, DoctorConfig
from globalkv.stack.doctor.report import Report, render_text
from kvplumbing.validation import validation_as_value_error

MANIFEST = "cluster.json"


def register(subparsers: Any) -> None:
    defaults = DoctorConfig()
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "doctor",
        help="diagnose a live cluster stage by stage (exit status 1 when something is wrong)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--gateway", help="the gateway's URL")
    add("--indexer", help="the indexer's URL")
    add(
        "--entry",
        help="where clients send requests, when not to --gateway: Envoy, with the endpoint "
        "picker (globalkv epp) as --gateway; the probe is sent here",
    )
    add("--run-dir", type=Path, help=f"a `globalkv up` run directory: addresses from {MANIFEST}")
    add("--api-key", help="the gateway's --api-key, if it has one")
    add(
        "--admin-token",
        help="the gateway's --admin-token, if it has one (its /workers and /v1/config need "
        "it when it has no API key); also sent with the indexer's lookups",
    )
    add("--timeout", type=float, default=defaults.timeout, help="seconds per request")
    add("--no-probe", action="store_true", help="send no request through the gateway")
    add(
        "--freshness-timeout",
        type=float,
        default=defaults.freshness_timeout,
        help="seconds the probe's KV events may take to reach the index",
    )
    add("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(run=run, check_config=check_config)


def config_from_args(args: argparse.Namespace, manifest: dict[str, Any]) -> DoctorConfig:
    recorded, entry = _recorded_gateway(manifest)
    gateway = args.gateway or recorded
    indexer = args.indexer or manifest.get("indexer_url")
    entry = args.entry or (entry if not args.gateway else None)
    if not gateway and not indexer:
        raise ValueError("give --gateway and/or --indexer (or the --run-dir of `globalkv up`)")
    with validation_as_value_error():
        return DoctorConfig(
            gateway=gateway,
            indexer=indexer,
            entry=entry,
            api_key=args.api_key,
            admin_token=args.admin_token,
            timeout=args.timeout,
            probe=not args.no_probe,
            freshness_timeout=args.freshness_timeout,
        )


def _recorded_gateway(manifest: dict[str, Any]) -> tuple[str | None, str | None]:
    """(gateway, entry) of a `globalkv up` manifest: behind Envoy its recorded gateway is
    Envoy, the entry, and the gateway doctor reads is the first endpoint picker."""
    components = manifest.get("components")
    listed = components if isinstance(components, list) else []
    pickers = [c.get("url") for c in listed if isinstance(c, dict) and c.get("role") == "epp"]
    if pickers and isinstance(pickers[0], str):
        return pickers[0], manifest.get("gateway_url")
    return manifest.get("gateway_url"), None


def read_manifest(run_dir: Path) -> dict[str, Any]:
    path = run_dir / MANIFEST
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def check_config(args: argparse.Namespace) -> None:
    """Flags only: a --run-dir stands in for the addresses it will provide."""
    stand_in = {"gateway_url": "http://127.0.0.1:1"} if args.run_dir else {}
    config_from_args(args, stand_in)


async def diagnose(config: DoctorConfig) -> Report:
    async with httpx.AsyncClient() as client:
        return await Doctor(config, client).run()


def run(args: argparse.Namespace) -> int:
    try:
        manifest = read_manifest(args.run_dir) if args.run_dir else {}
        config = config_from_args(args, manifest)
    except ValueError as exc:
        print(f"globalkv doctor: {exc}", file=sys.stderr)
        return 2
    # One line per request would bury the report.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    report = asyncio.run(diagnose(config))
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(render_text(report), end="")
    return report.exit_status
