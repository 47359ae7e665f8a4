"""components/monitoring's rules on whether globalkv is scraped at all, evaluated by
Prometheus' own rule engine (`promtool test rules`) over made-up `up` series: a component
whose targets are down, a component whose every target is gone while the rest of globalkv
in its namespace is scraped (which `up == 0` cannot see), nothing of globalkv scraped, and
the shapes that must stay quiet (the router-only shape runs no picker and no sidecar).

Each scenario runs for 30 minutes of samples, a minute apart; a target that goes away
sends its last sample at minute 5, after which Prometheus stops seeing it at minute 10."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.test_monitoring import MONITORING

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool (Prometheus) is not installed"
)
pytestmark = needs_promtool

PRESENT = "1x30"
GONE = "1x5"
DOWN = "0x30"
ROUTER = ("globalkv-gateway", "globalkv-indexer")
ENVOY = (*ROUTER, "globalkv-epp", "globalkv-sidecar")
WATCHED = ("GlobalkvComponentDown", "GlobalkvComponentAbsent", "GlobalkvNotScraped")


@dataclass
class Scenario:
    name: str
    jobs: dict[tuple[str, str], str]
    """(namespace, job) → the values of each of its two targets' `up`."""
    firing: dict[str, list[dict[str, str]]] = field(default_factory=dict)
    """Alert → the labels of each of its alerts firing at minute 30; the others in
    WATCHED fire none."""


def shape(
    jobs: tuple[str, ...], namespace: str = "llm", **values: str
) -> dict[tuple[str, str], str]:
    """Every job of a shape present in `namespace`, but those named in `values`
    (`globalkv_gateway="1x5"`)."""
    return {(namespace, job): values.get(job.replace("-", "_"), PRESENT) for job in jobs}


def absent(job: str, namespace: str = "llm") -> dict[str, str]:
    return {"severity": "critical", "namespace": namespace, "job": job}


SCENARIOS = [
    Scenario("the Envoy shape, every target up", shape(ENVOY)),
    Scenario("the router-only shape, every target up", shape(ROUTER)),
    Scenario(
        "every gateway gone",
        shape(ENVOY, globalkv_gateway=GONE),
        {"GlobalkvComponentAbsent": [absent("globalkv-gateway")]},
    ),
    Scenario(
        "every indexer gone, router-only",
        shape(ROUTER, globalkv_indexer=GONE),
        {"GlobalkvComponentAbsent": [absent("globalkv-indexer")]},
    ),
    Scenario(
        "every picker gone",
        shape(ENVOY, globalkv_epp=GONE),
        {"GlobalkvComponentAbsent": [absent("globalkv-epp")]},
    ),
    Scenario(
        "every sidecar gone",
        shape(ENVOY, globalkv_sidecar=GONE),
        {"GlobalkvComponentAbsent": [absent("globalkv-sidecar")]},
    ),
    Scenario(
        "one namespace of two loses its gateways",
        {**shape(ENVOY), **shape(ROUTER, "llm-b", globalkv_gateway=GONE)},
        {"GlobalkvComponentAbsent": [absent("globalkv-gateway", "llm-b")]},
    ),
    Scenario(
        "every sidecar down",
        shape(ENVOY, globalkv_sidecar=DOWN),
        {"GlobalkvComponentDown": [absent("globalkv-sidecar")]},
    ),
    Scenario(
        "everything gone",
        shape(ENVOY, **{job.replace("-", "_"): GONE for job in ENVOY}),
        {"GlobalkvNotScraped": [{"severity": "critical"}]},
    ),
]


def promtool_test(scenario: Scenario) -> dict[str, Any]:
    series = [
        {"series": f'up{{namespace="{ns}", job="{job}", pod="{job}-{i}"}}', "values": values}
        for (ns, job), values in scenario.jobs.items()
        for i in range(2)
    ]
    checks = [
        {
            "eval_time": "30m",
            "alertname": alert,
            "exp_alerts": [{"exp_labels": labels} for labels in scenario.firing.get(alert, [])],
        }
        for alert in WATCHED
    ]
    return {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": checks}],
    }


def write_rules(path: Path) -> None:
    """The PrometheusRule's groups as a Prometheus rule file, without annotations (their
    text is not what is tested here, and promtool compares them whole)."""
    rule = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())
    groups = rule["spec"]["groups"]
    for group in groups:
        for r in group["rules"]:
            r.pop("annotations", None)
    path.write_text(yaml.safe_dump({"groups": groups}))


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_which_scrape_alerts_fire(scenario: Scenario, tmp_path: Path) -> None:
    write_rules(tmp_path / "rules.yaml")
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(promtool_test(scenario)))
    done = subprocess.run(
        ["promtool", "test", "rules", "test.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
