"""deploy/kubernetes/components/monitoring: every alert rule is PromQL that reads globalkv's
metrics (or Prometheus' own `up`), selects the jobs its ServiceMonitors make, and says how
bad and what; every ServiceMonitor finds the Services it means, on a port they have. That
the rules read only metrics and labels the services really export is checked against a
running stack (tests/integration/test_up_envoy_stack.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from tests.deploy import dashboard
from tests.deploy.kustomize import COMPONENTS, by_kind, composed, engines, needs_kubectl

MONITORING = COMPONENTS / "monitoring"
TARGET_LABELS = {"namespace", "job", "pod", "instance", "service", "endpoint", "container"}
"""Labels Prometheus gives every series of a ServiceMonitor's target."""


def rules() -> list[dict[str, Any]]:
    rule = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


def rule_reads() -> list[tuple[str, dashboard.Read]]:
    """(alert, read) for every metric every rule reads."""
    return [
        (r["alert"], read) for r in rules() for read in dashboard.reads(dashboard.parse(r["expr"]))
    ]


def test_every_rule_is_promql_on_globalkv_metrics() -> None:
    names = [r["alert"] for r in rules()]
    assert len(names) == len(set(names))
    for alert, read in rule_reads():
        assert read.metric.startswith("globalkv_") or read.metric == "up", (alert, read)


def test_every_rule_says_how_bad_and_what() -> None:
    for rule in rules():
        assert rule["labels"]["severity"] in {"critical", "warning"}, rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]
        assert rule["annotations"]["description"], rule["alert"]
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]


@needs_kubectl
def test_the_rules_select_the_jobs_the_service_monitors_make(tmp_path: Path) -> None:
    """A target's job is its Service's name; every `job` the rules match is one a
    ServiceMonitor scrapes, and every Service a ServiceMonitor selects has its port."""
    objects = composed(
        tmp_path, resources=["overlays/in-cluster-redis"], components=["components/monitoring"]
    )
    services = by_kind(objects, "Service")
    scraped: set[str] = set()
    for monitor in by_kind(objects, "ServiceMonitor").values():
        selected = [s for s in services.values() if _selects(monitor["spec"]["selector"], s)]
        assert selected, monitor["metadata"]["name"]
        for service in selected:
            ports = {p["name"] for p in service["spec"]["ports"]}
            for endpoint in monitor["spec"]["endpoints"]:
                assert endpoint["port"] in ports, (monitor["metadata"]["name"], service)
            scraped.add(service["metadata"]["name"])
    assert scraped == {"globalkv-gateway", "globalkv-epp", "globalkv-indexer", "globalkv-sidecar"}
    for rule in rules():
        for job in re.findall(r'job=~"([^"]+)"', rule["expr"]):
            matched = {name for name in scraped if re.fullmatch(job, name)}
            assert matched == scraped, (rule["alert"], job)
        for job in re.findall(r'job="([^"]+)"', rule["expr"]):
            assert job in scraped, (rule["alert"], job)


@needs_kubectl
def test_the_sidecars_service_finds_each_decode_pods_sidecar(tmp_path: Path) -> None:
    """The sidecars have no Service of their own to serve; the one the monitoring
    selects them by matches the decode pods the engine components make, on the port the
    sidecar serves /metrics on."""
    service = by_kind(
        composed(tmp_path / "globalkv", resources=["overlays/in-cluster-redis"]), "Service"
    )["globalkv-sidecar"]["spec"]
    decode = by_kind(engines(tmp_path / "engines"), "Deployment")["sglang-decode"]["spec"][
        "template"
    ]
    assert service["selector"].items() <= decode["metadata"]["labels"].items()
    (port,) = service["ports"]
    (sidecar,) = [c for c in decode["spec"]["containers"] if c["name"] == "globalkv-sidecar"]
    named = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    assert named[port["targetPort"]] == port["port"]
    sidecar_env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert sidecar_env["GLOBALKV_SIDECAR_PORT"] == str(port["port"])
    assert sidecar_env["GLOBALKV_SIDECAR_PROMETHEUS_PORT"] == "0"  # /metrics on that port


def _selects(selector: dict[str, Any], service: dict[str, Any]) -> bool:
    labels = service["metadata"].get("labels", {})
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In"
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return True
