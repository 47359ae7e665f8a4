"""deploy/kubernetes: every overlay renders with `kubectl kustomize`, every object is valid
against the Kubernetes OpenAPI schemas (kubernetes-validate's, offline) or, for HTTPRoute
and InferencePool, the CRD schemas kept in tests/data/crds, and the production shape holds:
replicas, probes that mean something, non-root read-only containers, RBAC limited to
reading pods, secrets referenced rather than written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.support.kubeconfig import write_kubeconfig

ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZE = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (KUSTOMIZE / "overlays").iterdir() if p.is_dir())
KUBERNETES_VERSION = "1.32.0"
CONFIGURATION = (ROOT / "docs" / "configuration.md").read_text()
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
    assert {s["name"] for s in binding["subjects"]} == {
        "globalkv-gateway",
        "globalkv-epp",
        "globalkv-sidecar",
    }


def test_the_inference_pool_selects_the_decodes_sidecars_and_names_the_epp() -> None:
    objects = render("in-cluster-redis")
    pool = by_kind(objects, "InferencePool")["globalkv-llm"]["spec"]
    deployments = by_kind(objects, "Deployment")
    gateway, epp = (plain_env(deployments[name]) for name in ("globalkv-gateway", "globalkv-epp"))
    decodes = dict(p.split("=") for p in epp["GLOBALKV_EPP_DECODE_SELECTOR"].split(","))
    assert pool["selector"]["matchLabels"] == decodes
    assert pool["targetPorts"] == [
        {"number": int(epp["GLOBALKV_EPP_DECODE_SERVICE_DISCOVERY_PORT"])}
    ]
    assert epp["GLOBALKV_EPP_PREFILL_SELECTOR"] == gateway["GLOBALKV_GATEWAY_PREFILL_SELECTOR"]
    assert epp["GLOBALKV_EPP_DECODE_SELECTOR"] == gateway["GLOBALKV_GATEWAY_DECODE_SELECTOR"]
    service = by_kind(objects, "Service")["globalkv-epp"]
    assert pool["endpointPickerRef"]["name"] == service["metadata"]["name"]
    assert pool["endpointPickerRef"]["port"]["number"] == service["spec"]["ports"][0]["port"]
    (route,) = by_kind(objects, "HTTPRoute").values()
    assert route["spec"]["rules"][0]["backendRefs"][0]["name"] == "globalkv-llm"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_command_accepts_the_settings_its_manifest_gives(overlay: str, tmp_path: Path) -> None:
    """Every `GLOBALKV_<COMMAND>_*` variable is one of the command's flags, and the command
    checks the whole configuration (`globalkv --check`) without complaint, given the
    credentials a pod has (a kubeconfig stands in for its service account)."""
    kubeconfig = {"KUBECONFIG": str(write_kubeconfig(tmp_path / "kubeconfig"))}
    for name, deployment in by_kind(render(overlay), "Deployment").items():
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        if not container["image"].startswith("globalkv"):
            continue
        (command,) = container["args"]
        env = {
            variable: "redis://redis:6379/0" if variable.endswith("_REDIS_URL") else value
            for variable, value in plain_env(deployment, secret="s3cret", namespace="llm").items()
        }
        prefix = f"GLOBALKV_{command.upper()}_"
        for variable in env:
            if variable.startswith("GLOBALKV_"):
                assert variable.startswith(prefix), f"{name}: {variable}"
                assert f"`{variable}`" in CONFIGURATION, f"{name}: {variable} is no flag's"
        done = subprocess.run(
            [sys.executable, "-m", "globalkv", "--check", command],
            env={**os.environ, **kubeconfig, **env},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, f"{name}: {done.stderr}"


def plain_env(
    deployment: dict[str, Any], *, secret: str | None = None, namespace: str | None = None
) -> dict[str, str]:
    """The first container's variables with a value, and, when given, `secret` for each
    read from a Secret and `namespace` for the pod's namespace."""
    (container, *_) = deployment["spec"]["template"]["spec"]["containers"]
    env: dict[str, str] = {}
    for item in container.get("env", []):
        source = item.get("valueFrom", {})
        if "value" in item:
            env[item["name"]] = item["value"]
        elif "secretKeyRef" in source and secret is not None:
            env[item["name"]] = secret
        elif source.get("fieldRef", {}).get("fieldPath") == "metadata.namespace" and namespace:
            env[item["name"]] = namespace
    return env
