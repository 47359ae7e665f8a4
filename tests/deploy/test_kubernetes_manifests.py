"""deploy/kubernetes: every overlay renders with `kubectl kustomize`, every object is valid
against the Kubernetes OpenAPI schemas (kubernetes-validate's, offline) or, for the Gateway
API, Inference Extension and Prometheus Operator objects, the CRD schemas kept in
tests/data/crds; the production shape holds; and every command the manifests run starts
as deployed: it passes `globalkv --check` with the settings its manifest gives, in an
image built as docs/kubernetes.md builds it, and routes by prefix."""

from __future__ import annotations

import json
import os
import re
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from tests.deploy.kustomize import (
    ENVOY_OVERLAYS,
    OVERLAYS,
    ROOT,
    by_kind,
    composed,
    container_env,
    engines,
    needs_kubectl,
    overlay,
)
from tests.support.extras import run_with_extras
from tests.support.kubeconfig import write_kubeconfig

KUBERNETES_VERSION = "1.32.0"
CONFIGURATION = (ROOT / "docs" / "configuration.md").read_text()
KUBERNETES_DOC = (ROOT / "docs" / "kubernetes.md").read_text()
DOCKERFILE = (ROOT / "Dockerfile").read_text()
CRDS = {
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute-v1.schema.json",
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-v1.schema.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-v1.schema.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule-v1.schema.json",
}
GATEWAY_API_GROUPS = ("gateway.networking.k8s.io/", "inference.networking.k8s.io/")

pytestmark = needs_kubectl


def test_the_overlays() -> None:
    assert OVERLAYS == ["external-redis", "in-cluster-redis", "router-only"]


@cache
def strict(crd: str) -> dict[str, Any]:
    """The CRD's schema, refusing fields it does not name, as the API server prunes them
    (a misspelt field would otherwise pass, and be dropped in the cluster)."""
    schema: dict[str, Any] = json.loads((ROOT / "tests" / "data" / "crds" / crd).read_text())

    def close(node: Any) -> None:
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for child in node.values():
                close(child)
        elif isinstance(node, list):
            for child in node:
                close(child)

    close(schema)
    schema["properties"]["metadata"] = {"type": "object"}
    return schema


def validate(objects: list[dict[str, Any]]) -> None:
    for obj in objects:
        crd = CRDS.get((obj["apiVersion"], obj["kind"]))
        if crd is None:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        else:
            # Not jsonschema.validate: it checks the schema's patterns as Python regexes,
            # and the Prometheus Operator writes Go's `^(?i)…`.
            schema = strict(crd)
            jsonschema.validators.validator_for(schema)(schema).validate(obj)


@pytest.mark.parametrize("name", OVERLAYS)
def test_every_object_is_valid(name: str) -> None:
    validate(overlay(name))


def test_the_monitoring_and_engine_components_are_valid(tmp_path: Path) -> None:
    monitored = composed(
        tmp_path / "monitored",
        resources=["overlays/in-cluster-redis"],
        components=["components/monitoring"],
    )
    assert {"globalkv", "globalkv-indexer", "globalkv-sidecar"} == set(
        by_kind(monitored, "ServiceMonitor")
    )
    assert set(by_kind(monitored, "PrometheusRule")) == {"globalkv"}
    validate(monitored)
    validate(engines(tmp_path / "engines"))


def test_a_misspelt_field_is_refused() -> None:
    """The strict schemas can fail."""
    rule = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "x"},
        "spec": {"groups": [{"name": "g", "rules": [{"alert": "A", "expresion": "up == 0"}]}]},
    }
    with pytest.raises(jsonschema.ValidationError, match="expresion"):
        validate([rule])


@pytest.mark.parametrize("name", OVERLAYS)
def test_the_production_shape(name: str) -> None:
    objects = overlay(name)
    deployments = by_kind(objects, "Deployment")
    assert deployments["globalkv-gateway"]["spec"]["replicas"] >= 2
    assert deployments["globalkv-indexer"]["spec"]["replicas"] >= 2
    ours = {n for n in deployments if n != "globalkv-redis"}
    assert ours <= set(by_kind(objects, "PodDisruptionBudget"))
    for deployment_name, deployment in deployments.items():
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, deployment_name
        for container in pod["containers"]:
            check_container(container, deployment_name)
            if container["image"].startswith("globalkv"):
                assert pod["securityContext"]["runAsUser"] == 10001, deployment_name
    gateway = deployments["globalkv-gateway"]["spec"]["template"]["spec"]["containers"][0]
    indexer = deployments["globalkv-indexer"]["spec"]["template"]["spec"]["containers"][0]
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/readiness"
    assert indexer["readinessProbe"]["httpGet"]["path"] == "/health"
    for container in (gateway, indexer):
        env = {e["name"]: e for e in container["env"]}
        token = next(e for n, e in env.items() if n.endswith("_ADMIN_TOKEN"))
        assert token["valueFrom"]["secretKeyRef"] == {"name": "globalkv-admin", "key": "token"}
        redis = next(e for n, e in env.items() if n.endswith("_REDIS_URL"))
        assert redis["valueFrom"]["secretKeyRef"]["name"] == "globalkv-redis"
    assert "globalkv-redis" in by_kind(objects, "Secret")


def check_container(container: dict[str, Any], where: str) -> None:
    context = container["securityContext"]
    assert context["readOnlyRootFilesystem"] is True, where
    assert context["allowPrivilegeEscalation"] is False, where
    assert context["capabilities"]["drop"] == ["ALL"], where
    assert {"readinessProbe", "livenessProbe"} <= set(container), where
    assert container["resources"]["requests"], where
    assert container["resources"]["limits"], where
    if container["image"].startswith(("globalkv", "registry.example.com/globalkv")):
        assert "/tmp" in {m["mountPath"] for m in container["volumeMounts"]}, where


@pytest.mark.parametrize("name", OVERLAYS)
def test_rbac_reads_pods_in_the_namespace_only(name: str) -> None:
    objects = overlay(name)
    assert not by_kind(objects, "ClusterRole")
    assert not by_kind(objects, "ClusterRoleBinding")
    (role,) = by_kind(objects, "Role").values()
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    bound = {
        subject["name"]
        for binding in by_kind(objects, "RoleBinding").values()
        if binding["roleRef"]["name"] == role["metadata"]["name"]
        for subject in binding["subjects"]
    }
    picker = {"globalkv-epp", "globalkv-sidecar"} if name in ENVOY_OVERLAYS else set()
    assert bound == {"globalkv-gateway", *picker}


def test_the_router_only_overlay_has_no_gateway_api_object_and_no_picker() -> None:
    objects = overlay("router-only")
    assert not [o for o in objects if o["apiVersion"].startswith(GATEWAY_API_GROUPS)]
    assert set(by_kind(objects, "Deployment")) == {
        "globalkv-gateway",
        "globalkv-indexer",
        "globalkv-redis",
    }
    assert set(by_kind(objects, "ServiceAccount")) == {"globalkv-gateway", "globalkv-indexer"}


@pytest.mark.parametrize("name", ENVOY_OVERLAYS)
def test_the_inference_pool_selects_the_decodes_sidecars_and_names_the_epp(
    name: str, tmp_path: Path
) -> None:
    objects = overlay(name)
    pool = by_kind(objects, "InferencePool")["globalkv-llm"]["spec"]
    epp, gateway = (env_of(objects, n) for n in ("globalkv-epp", "globalkv-gateway"))
    decodes = dict(p.split("=") for p in epp["GLOBALKV_EPP_DECODE_SELECTOR"].split(","))
    assert pool["selector"]["matchLabels"] == decodes
    assert pool["targetPorts"] == [
        {"number": int(epp["GLOBALKV_EPP_DECODE_SERVICE_DISCOVERY_PORT"])}
    ]
    assert epp["GLOBALKV_EPP_PREFILL_SELECTOR"] == gateway["GLOBALKV_GATEWAY_PREFILL_SELECTOR"]
    assert epp["GLOBALKV_EPP_DECODE_SELECTOR"] == gateway["GLOBALKV_GATEWAY_DECODE_SELECTOR"]
    service = by_kind(objects, "Service")["globalkv-epp"]
    grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert pool["endpointPickerRef"]["name"] == service["metadata"]["name"]
    assert pool["endpointPickerRef"]["port"]["number"] == grpc["port"]
    (route,) = by_kind(objects, "HTTPRoute").values()
    assert route["spec"]["rules"][0]["backendRefs"][0]["name"] == "globalkv-llm"
    # The decode pods, patched by the engine components, are what the pool selects: the
    # labels, and the sidecar on the pool's port in front of the engine.
    decode = by_kind(engines(tmp_path), "Deployment")["sglang-decode"]["spec"]["template"]
    assert decodes.items() <= decode["metadata"]["labels"].items()
    sidecar = next(c for c in decode["spec"]["containers"] if c["name"] == "globalkv-sidecar")
    assert [p["containerPort"] for p in sidecar["ports"]] == [pool["targetPorts"][0]["number"]]
    assert decode["spec"]["serviceAccountName"] == "globalkv-sidecar"


def test_the_prefill_pods_carry_what_the_gateway_follows(tmp_path: Path) -> None:
    gateway = env_of(overlay("router-only"), "globalkv-gateway")
    objects = engines(tmp_path)
    prefill = by_kind(objects, "Deployment")["sglang-prefill"]["spec"]["template"]
    wanted = dict(p.split("=") for p in gateway["GLOBALKV_GATEWAY_PREFILL_SELECTOR"].split(","))
    assert wanted.items() <= prefill["metadata"]["labels"].items()
    assert prefill["metadata"]["annotations"]["sglang.ai/bootstrap-port"].isdigit()
    assert [c["name"] for c in prefill["spec"]["containers"]] == ["engine"]
    assert not by_kind(objects, "ConfigMap"), "the component's local-config is not rendered"


def test_the_prefill_engines_topic_names_its_pod(tmp_path: Path) -> None:
    """The documented `--kv-events-config` names the pod by `$(POD_NAME)`, which the kubelet
    expands only from a variable the container defines: the component defines it, from the
    pod's name."""
    prefill = by_kind(engines(tmp_path), "Deployment")["sglang-prefill"]["spec"]["template"]
    (engine,) = prefill["spec"]["containers"]
    referred = set(re.findall(r"\$\((\w+)\)", " ".join(engine["args"])))
    assert referred == {"POD_NAME"}
    pod = {"metadata.name": "sglang-prefill-6c9f7b8d4-abcde", "metadata.namespace": "llm"}
    env = container_env(engine, [], pod=pod)
    assert env == {"POD_NAME": pod["metadata.name"]}


def env_of(objects: list[dict[str, Any]], deployment: str) -> dict[str, str]:
    spec = by_kind(objects, "Deployment")[deployment]["spec"]["template"]["spec"]
    return container_env(spec["containers"][0], objects)


def image_extras() -> list[str]:
    """The extras of the image `docker build .` makes: the Dockerfile's default EXTRAS."""
    (default,) = re.findall(r'^ARG EXTRAS="([^"]*)"$', DOCKERFILE, re.M)
    return [e for e in default.split(",") if e]


def test_the_documented_image_is_the_default_build() -> None:
    """docs/kubernetes.md builds the image as `docker build .` does: no `--build-arg
    EXTRAS`, which would replace the default extras the checks below were run with."""
    builds = re.findall(r"^docker build .*$", KUBERNETES_DOC, re.M)
    assert builds
    for line in builds:
        assert "EXTRAS" not in line, line
    assert f"default, `{','.join(image_extras())}`," in DOCKERFILE


POD = {"metadata.name": "globalkv-7d9f8c6b5-x2x4q", "metadata.namespace": "llm"}
"""A stand-in pod's fields, for the variables the manifests take from the downward API."""


def commands(name: str, tmp_path: Path) -> list[tuple[str, str, dict[str, str]]]:
    """(where, command, environment) of every globalkv container the overlay deploys, and
    of the decode sidecar, as the kubelet starts them (Secrets and the pod as stand-ins):
    every variable the manifest defines, none left out."""
    objects = overlay(name)
    containers = [
        (n, c)
        for n, d in by_kind(objects, "Deployment").items()
        for c in d["spec"]["template"]["spec"]["containers"]
    ]
    if name in ENVOY_OVERLAYS:
        decode = by_kind(engines(tmp_path / "engines"), "Deployment")["sglang-decode"]
        containers += [
            ("sglang-decode", c) for c in decode["spec"]["template"]["spec"]["containers"]
        ]
    found = []
    for where, container in containers:
        if "globalkv" not in container["image"]:
            continue
        (command,) = container["args"]
        env = container_env(container, objects, secret="s3cret", pod=POD)
        assert set(env) == {e["name"] for e in container["env"]}, where
        env = {k: "redis://redis:6379/0" if k.endswith("_REDIS_URL") else v for k, v in env.items()}
        found.append((where, command, env))
    return found


def host_env() -> dict[str, str]:
    """This host's environment without what a pod would not have: our variables, and
    Hugging Face's offline switches (a pod reaches the Hub unless told otherwise)."""
    dropped = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    return {
        k: v for k, v in os.environ.items() if not k.startswith("GLOBALKV_") and k not in dropped
    }


@pytest.mark.parametrize("name", OVERLAYS)
def test_each_command_starts_as_deployed_in_the_documented_image(name: str, tmp_path: Path) -> None:
    """Every `GLOBALKV_<COMMAND>_*` variable is one of the command's flags, and the command
    passes `globalkv --check` with its manifest's settings, where only the extras of the
    default image can be imported, given the credentials a pod has (a kubeconfig stands
    in for its service account). A gateway, picker or sidecar routes prompts by prefix:
    an index, a tokenizer and a model are set."""
    kubeconfig = str(write_kubeconfig(tmp_path / "kubeconfig"))
    base = host_env()
    extras = image_extras()
    for where, command, env in commands(name, tmp_path):
        prefix = f"GLOBALKV_{command.upper()}_"
        for variable in env:
            if variable.startswith("GLOBALKV_"):
                assert variable.startswith(prefix), f"{where}: {variable}"
                assert f"`{variable}`" in CONFIGURATION, f"{where}: {variable} is no flag's"
        done = run_with_extras(
            extras, ["--check", command], {**base, "KUBECONFIG": kubeconfig, **env}
        )
        assert done.returncode == 0, f"{where}: {done.stderr}"
        if command in ("gateway", "epp", "sidecar"):
            said = done.stdout
            assert "prefill policy: prefix: the prefill holding the longest" in said, said
            assert f"model: {env[prefix + 'MODEL']}\n" in said, said
            assert f"tokenizer: {env[prefix + 'TOKENIZER']} (Hugging Face id" in said, said


@pytest.mark.parametrize("extra", image_extras())
def test_each_extra_of_the_image_is_needed(extra: str, tmp_path: Path) -> None:
    """The check above can fail: without any one of the image's extras, some command the
    manifests deploy would not start, and says which extra to install."""
    kept = [e for e in image_extras() if e != extra]
    kubeconfig = str(write_kubeconfig(tmp_path / "kubeconfig"))
    for _, command, env in commands("in-cluster-redis", tmp_path):
        done = run_with_extras(
            kept, ["--check", command], {**host_env(), "KUBECONFIG": kubeconfig, **env}
        )
        if done.returncode != 0:
            assert done.returncode == 2, done.stderr
            assert f"pip install 'globalkv[{extra}]'" in done.stderr, done.stderr
            return
    pytest.fail(f"every command starts without the {extra} extra")


def test_the_docs_edit_files_not_kustomize() -> None:
    """`kustomize edit` is another tool to install; the docs edit plain files instead."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for doc in docs:
        assert "kustomize edit" not in doc.read_text(), doc.name
