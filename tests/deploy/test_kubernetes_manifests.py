"""deploy/kubernetes: every overlay renders with `kubectl kustomize`, every object is valid
against the Kubernetes OpenAPI schemas (kubernetes-validate's, offline) or, for HTTPRoute
and InferencePool, the CRD schemas kept in tests/data/crds, and the production shape holds:
replicas, probes that mean something, non-root read-only containers, RBAC limited to
reading pods, secrets referenced rather than written."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZE = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (KUSTOMIZE / "overlays").iterdir() if p.is_dir())
KUBERNETES_VERSION = "1.32.0"
CRDS = {
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute-v1.schema.json",
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-v1.schema.json",
}

pytestmark = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl (with kustomize) is not installed"
)


def render(overlay: str) -> list[dict[str, Any]]:
    done = subprocess.run(
        ["kubectl", "kustomize", str(KUSTOMIZE / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def test_both_overlays_exist() -> None:
    assert OVERLAYS == ["external-redis", "in-cluster-redis"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_is_valid(overlay: str) -> None:
    for obj in render(overlay):
        crd = CRDS.get((obj["apiVersion"], obj["kind"]))
        if crd is None:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
            continue
        schema = json.loads((ROOT / "tests" / "data" / "crds" / crd).read_text())
        jsonschema.validate(obj, schema)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_production_shape(overlay: str) -> None:
    objects = render(overlay)
    deployments = by_kind(objects, "Deployment")
    assert deployments["globalkv-gateway"]["spec"]["replicas"] >= 2
    assert deployments["globalkv-indexer"]["spec"]["replicas"] >= 2
    assert {"globalkv-gateway", "globalkv-indexer", "globalkv-epp"} <= set(
        by_kind(objects, "PodDisruptionBudget")
    )
    for name, deployment in deployments.items():
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True, name
            assert context["allowPrivilegeEscalation"] is False, name
            assert context["capabilities"]["drop"] == ["ALL"], name
            assert {"readinessProbe", "livenessProbe"} <= set(container), name
            assert container["resources"]["requests"]
            assert container["resources"]["limits"]
            if container["image"].startswith("globalkv"):
                assert pod["securityContext"]["runAsUser"] == 10001, name
                assert "/tmp" in {m["mountPath"] for m in container["volumeMounts"]}, name
    gateway = deployments["globalkv-gateway"]["spec"]["template"]["spec"]["containers"][0]
    indexer = deployments["globalkv-indexer"]["spec"]["template"]["spec"]["containers"][0]
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/readiness"
    assert indexer["readinessProbe"]["httpGet"]["path"] == "/health"
    for container in (gateway, indexer):
        env = {e["name"]: e for e in container["env"]}
        token = next(e for name, e in env.items() if name.endswith("_ADMIN_TOKEN"))
        assert token["valueFrom"]["secretKeyRef"] == {"name": "globalkv-admin", "key": "token"}
        redis = next(e for name, e in env.items() if name.endswith("_REDIS_URL"))
        assert redis["valueFrom"]["secretKeyRef"]["name"] == "globalkv-redis"
    assert "globalkv-redis" in by_kind(objects, "Secret")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rbac_reads_pods_in_the_namespace_only(overlay: str) -> None:
    objects = render(overlay)
    assert not by_kind(objects, "ClusterRole")
    assert not by_kind(objects, "ClusterRoleBinding")
    (role,) = by_kind(objects, "Role").values()
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    (binding,) = by_kind(objects, "RoleBinding").values()
    assert {s["name"] for s in binding["subjects"]} == {"globalkv-gateway", "globalkv-epp"}


def test_the_inference_pool_selects_the_model_servers_and_names_the_epp() -> None:
    objects = render("in-cluster-redis")
    pool = by_kind(objects, "InferencePool")["globalkv-llm"]["spec"]
    gateway = by_kind(objects, "Deployment")["globalkv-gateway"]
    env = {
        e["name"]: e.get("value")
        for e in gateway["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    for role in ("PREFILL", "DECODE"):
        selector = dict(p.split("=") for p in env[f"GLOBALKV_GATEWAY_{role}_SELECTOR"].split(","))
        assert pool["selector"]["matchLabels"].items() <= selector.items()
    epp = by_kind(objects, "Service")["globalkv-epp"]
    assert pool["endpointPickerRef"]["name"] == epp["metadata"]["name"]
    assert pool["endpointPickerRef"]["port"]["number"] == epp["spec"]["ports"][0]["port"]
    (route,) = by_kind(objects, "HTTPRoute").values()
    assert route["spec"]["rules"][0]["backendRefs"][0]["name"] == "globalkv-llm"
