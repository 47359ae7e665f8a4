"""docs/kubernetes.md's tokenizer for a cluster that reaches no Hugging Face Hub: its two
patches, applied as written to an Envoy overlay and to a user's engines, mount the
tokenizer's volume in every container that reads model.env's tokenizer (the gateway, the
picker and each decode's sidecar), and each of those passes `globalkv --check` with the
directory the volume stands for. A container left without the mount would stop at its
start: a local tokenizer path that is missing fails the check start-up runs."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.kustomize import ROOT, by_kind, composed, container_env, engines, needs_kubectl
from tests.deploy.test_kubernetes_manifests import POD, host_env, image_extras
from tests.support.extras import run_with_extras
from tests.support.kubeconfig import write_kubeconfig
from tests.test_tokenize import build_core, write_model

DOC = (ROOT / "docs" / "kubernetes.md").read_text()
TOKENIZER = "/models/qwen3-8b"
"""The directory the docs name in model.env and mount."""

pytestmark = needs_kubectl


def documented_patches() -> dict[str, list[dict[str, Any]]]:
    """The `patches` of each block the docs head `# your <who>'s kustomization.yaml`."""
    blocks = re.findall(r"```yaml\n# your (\w+)'s? kustomization\.yaml\n(.*?)```", DOC, re.S)
    return {who: yaml.safe_load(text)["patches"] for who, text in blocks}


def mounted(pod: dict[str, Any], container: dict[str, Any], path: str) -> dict[str, Any]:
    """The pod's volume `container` sees at `path`."""
    mounts = [m for m in container.get("volumeMounts", []) if m["mountPath"] == path]
    assert len(mounts) == 1, f"{container['name']} mounts nothing at {path}"
    (volume,) = [v for v in pod["volumes"] if v["name"] == mounts[0]["name"]]
    return volume


def test_every_container_reading_the_tokenizer_mounts_it_and_checks(tmp_path: Path) -> None:
    patches = documented_patches()
    assert set(patches) == {"overlay", "engines"}
    # model.env's tokenizer as the docs set it, merged as an overlay would.
    model = {
        "name": "globalkv-model",
        "behavior": "merge",
        "literals": [f"tokenizer={TOKENIZER}"],
        "options": {"disableNameSuffixHash": True},
    }
    objects = composed(
        tmp_path / "globalkv",
        resources=["overlays/in-cluster-redis"],
        extra={"patches": patches["overlay"], "configMapGenerator": [model]},
    )
    users = engines(tmp_path / "engines", {"patches": patches["engines"]})
    deployments = {**by_kind(objects, "Deployment"), **by_kind(users, "Deployment")}
    volume = tmp_path / "volume"
    write_model(volume, build_core(), {"bos_token": "<s>"})
    kubeconfig = str(write_kubeconfig(tmp_path / "kubeconfig"))
    checked = set()
    for name, deployment in deployments.items():
        pod = deployment["spec"]["template"]["spec"]
        for container in pod["containers"]:
            env = container_env(container, objects, secret="s3cret", pod=POD)
            variable = next((v for v in env if v.endswith("_TOKENIZER")), None)
            if variable is None:
                continue
            assert env[variable] == TOKENIZER, name
            claim = mounted(pod, container, TOKENIZER)["persistentVolumeClaim"]
            assert claim["readOnly"] is True, name
            assert env["HF_HUB_OFFLINE"] == "1", name
            env = {
                k: "redis://redis:6379/0" if k.endswith("_REDIS_URL") else v for k, v in env.items()
            }
            env[variable] = str(volume)  # the volume, where the pod would mount it
            (command,) = container["args"]
            done = run_with_extras(
                image_extras(),
                ["--check", command],
                {**host_env(), "KUBECONFIG": kubeconfig, **env},
            )
            assert done.returncode == 0, f"{name}: {done.stderr}"
            assert f"tokenizer: {volume} (loaded" in done.stdout, done.stdout
            checked.add(f"{name}/{container['name']}")
    assert checked == {
        "globalkv-gateway/gateway",
        "globalkv-epp/epp",
        "sglang-decode/globalkv-sidecar",
    }
