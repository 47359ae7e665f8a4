"""deploy/kubernetes rendered by `kubectl kustomize` as a user renders it: each overlay, an
overlay with the monitoring component added, and a user's engines with the engine
components, each from a kustomization of its own (kustomize reads component directories
by relative path, so the test's kustomization lives in a temporary directory beside them).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZE = ROOT / "deploy" / "kubernetes"
COMPONENTS = KUSTOMIZE / "components"
OVERLAYS = sorted(p.name for p in (KUSTOMIZE / "overlays").iterdir() if p.is_dir())
ENVOY_OVERLAYS = ["external-redis", "in-cluster-redis"]
"""The overlays with the endpoint picker and the Gateway API objects."""

needs_kubectl = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl (with kustomize) is not installed"
)


def render(directory: Path) -> list[dict[str, Any]]:
    done = subprocess.run(
        ["kubectl", "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def overlay(name: str) -> list[dict[str, Any]]:
    return render(KUSTOMIZE / "overlays" / name)


def composed(
    where: Path,
    *,
    resources: Sequence[str] = (),
    components: Sequence[str] = (),
    files: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """A kustomization written in `where` (with `files` beside it), of `resources` and of
    `components`, which are directories of deploy/kubernetes, and the `extra` fields a
    user's kustomization adds (`patches`, a `configMapGenerator`)."""
    where.mkdir(parents=True, exist_ok=True)
    for name, text in (files or {}).items():
        (where / name).write_text(text)
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [
            r if r in (files or {}) else os.path.relpath(KUSTOMIZE / r, where) for r in resources
        ],
        "components": [os.path.relpath(KUSTOMIZE / c, where) for c in components],
        "images": [{"name": "globalkv", "newName": "registry.example.com/globalkv"}],
        **(extra or {}),
    }
    (where / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return render(where)


def documented_kv_events_config() -> str:
    """The prefills' `--kv-events-config` as docs/kubernetes.md gives it."""
    doc = (ROOT / "docs" / "kubernetes.md").read_text()
    found = re.search(r"SGLang `--kv-events-config '([^']+)'`", doc)
    assert found, "docs/kubernetes.md gives no --kv-events-config"
    return found.group(1)


def engines(where: Path, extra: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """A user's SGLang prefill and decode Deployments, labelled by role, the prefill
    publishing KV events as docs/kubernetes.md says, with the engine components applied
    (and the `extra` fields of the user's kustomization)."""
    files = {f"{role}.yaml": yaml.safe_dump(_engine(role)) for role in ("prefill", "decode")}
    return composed(
        where,
        resources=list(files),
        components=["components/prefill-engines", "components/decode-sidecars"],
        files=files,
        extra=extra,
    )


def _engine(role: str) -> dict[str, Any]:
    labels = {"app": f"sglang-{role}"}
    args = ["python3", "-m", "sglang.launch_server"]
    if role == "prefill":
        args += ["--kv-events-config", documented_kv_events_config()]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": f"sglang-{role}", "labels": {"globalkv.io/role": role}},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [
                        {
                            "name": "engine",
                            "image": "lmsysorg/sglang:v0.5.23",
                            "args": args,
                            "ports": [{"name": "http", "containerPort": 30000}],
                        }
                    ]
                },
            },
        },
    }


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def container_env(
    container: dict[str, Any],
    objects: list[dict[str, Any]],
    *,
    secret: str | None = None,
    pod: dict[str, str] | None = None,
) -> dict[str, str]:
    """The container's variables as the kubelet would set them: values, ConfigMap keys read
    from `objects`, and, when given, `secret` for each Secret key and `pod`'s fields
    (`metadata.name`, `metadata.namespace`) for the downward API's."""
    maps = by_kind(objects, "ConfigMap")
    env: dict[str, str] = {}
    for item in container.get("env", []):
        source = item.get("valueFrom", {})
        field = source.get("fieldRef", {}).get("fieldPath")
        if "value" in item:
            env[item["name"]] = item["value"]
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[item["name"]] = maps[ref["name"]]["data"][ref["key"]]
        elif "secretKeyRef" in source and secret is not None:
            env[item["name"]] = secret
        elif pod is not None and field in pod:
            env[item["name"]] = pod[field]
    return env
